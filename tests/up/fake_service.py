"""A stand-in for `python -m llmgw <service> ...` used to test the supervisor quickly.

Invoked as `python fake_service.py <llmgw argv...>`. It names itself like the plan
does (the --endpoint id, else the subcommand), prints that service's ready line,
and then behaves as FAKE_SERVICE_BEHAVIOR (JSON {name: mode}) says:
  ready (default)       stay up until SIGTERM;
  exit-before-ready     print a line and exit 3 without the ready line;
  silent                never print the ready line;
  crash-after-ready     exit 3 right after the ready line;
  ignore-sigterm        stay up and ignore SIGTERM (needs SIGKILL).
Every start and every SIGTERM is appended to FAKE_SERVICE_EVENTS ("start NAME PID" lines).
"""

import json
import os
import signal
import sys
import time


def main(argv: list[str]) -> int:
    name = argv[argv.index("--endpoint") + 1] if "--endpoint" in argv else argv[0]
    mode = json.loads(os.environ.get("FAKE_SERVICE_BEHAVIOR", "{}")).get(name, "ready")
    events = os.environ.get("FAKE_SERVICE_EVENTS")

    def record(event: str) -> None:
        if events:
            with open(events, "a", encoding="utf-8") as file:
                file.write(f"{event} {name} {os.getpid()}\n")

    def on_sigterm(signum: int, frame: object) -> None:
        record("sigterm")
        raise SystemExit(0)

    signal.signal(signal.SIGTERM, signal.SIG_IGN if mode == "ignore-sigterm" else on_sigterm)
    record("start")
    print(f"hello from {name}", flush=True)
    if mode == "exit-before-ready":
        print("cannot bind: address already in use", file=sys.stderr, flush=True)
        return 3
    if mode != "silent":
        ready = {
            "sim": f"llmgw sim {argv[1] if len(argv) > 1 else 'engine'} ready on "
            "http://127.0.0.1:1",
            "admission": "llmgw admission ready",
            "edge": "llmgw edge ready on http://127.0.0.1:18080",
        }[argv[0]]
        print(ready, flush=True)
    if mode == "crash-after-ready":
        return 3
    while True:
        time.sleep(3600)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
