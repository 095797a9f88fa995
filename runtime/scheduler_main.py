"""Entry point of the scheduler process: `python -m plait.runtime.scheduler_main ARGS.pkl`.

The Engine writes (server_args, model_path, addresses) to a pickle file in its private temp folder
and starts this module in a fresh interpreter.
"""

import os
import pickle
import sys


def main() -> None:
    with open(sys.argv[1], "rb") as f:
        server_args, model_path, to_sched, from_sched, ready_addr = pickle.load(f)
    # The scheduler must not outlive its engine: exit when the parent process goes away.
    parent = os.getppid()
    import threading
    import time

    def watch_parent():
        while True:
            time.sleep(1.0)
            if os.getppid() != parent:
                os._exit(0)

    threading.Thread(target=watch_parent, daemon=True).start()
    from .scheduler import run_scheduler_process

    run_scheduler_process(server_args, model_path, to_sched, from_sched, ready_addr)


if __name__ == "__main__":
    main()
