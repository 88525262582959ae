"""The loop the RL-client drivers (tests/skyrl_driver.py, tests/areal_driver.py) share; they run in
the frameworks' own venvs (.peers/, scripts/rl_clients.sh), so this imports nothing but the stdlib.

One JSON object a line on stdin, `{"op": NAME, "args": {...}}`, answered by one JSON line on stdout:
the op's result, or `{"error": ...}`. With `"task": ID` the op runs in the background and the answer
is `{"started": ID}`; `{"op": "join", "task": ID}` later answers with its result. From the import of
this module on, whatever else is printed (the frameworks log to stdout) goes to stderr, so stdout
carries only the answers: drivers import it before the framework.
"""

import asyncio
import json
import os
import sys
import traceback

ANSWERS = os.fdopen(os.dup(1), "w", buffering=1)
os.dup2(2, 1)
sys.stdout = sys.stderr


def serve(ops: dict, close=None) -> None:
    """Answer requests for `ops` (name → async function of the request's args) until stdin closes,
    then await `close()` if given."""
    asyncio.run(loop(ops, close))


async def loop(ops: dict, close) -> None:
    tasks: dict[str, asyncio.Task] = {}
    while line := await asyncio.to_thread(sys.stdin.readline):
        request = json.loads(line)
        if request["op"] == "join":
            answer = await outcome(tasks.pop(request["task"]))
        elif "task" in request:
            tasks[request["task"]] = asyncio.create_task(ops[request["op"]](**request.get("args", {})))
            answer = {"started": request["task"]}
        else:
            answer = await outcome(ops[request["op"]](**request.get("args", {})))
        ANSWERS.write(json.dumps(answer) + "\n")
    if close is not None:
        await close()


async def outcome(awaitable) -> dict:
    try:
        return await awaitable
    except Exception as exc:  # the test reads what the client raised
        traceback.print_exc()
        return {"error": f"{type(exc).__name__}: {exc}"}
