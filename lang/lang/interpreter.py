"""`sglang.lang.interpreter`: plait's program state and executor under SGLang's module path."""

from plait.interpreter import StreamExecutor
from plait.state import ProgramState, ProgramStateGroup

__all__ = ["ProgramState", "ProgramStateGroup", "StreamExecutor"]
