"""`plait.integrations.ray_serve`: plait on Ray Serve (`build_app`, the `PlaitServer` replica, the
`PlaitIngress` OpenAI app), as `plait.runtime.integrations.ray_serve` defines them. Importing it imports Ray
and the runtime."""

from ..runtime.integrations.ray_serve import PlaitIngress, PlaitServer, build_app

__all__ = ["PlaitIngress", "PlaitServer", "build_app"]
