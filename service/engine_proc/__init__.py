"""The engine core in a process of its own (`stencild serve --engine-process`).

In one process the event loop, the engine thread and the device thread take
turns on one GIL, so every microsecond the event loop spends on a stream's
message lands on the engine's step. Here the engine (its engine and device
threads) runs in a child process; the server keeps the event loop, admission
and the streams, and talks to it over two pipes: client.py (the server's
side), child.py (the process), wire.py (what crosses).
"""

from .client import EngineProcess, EngineProcessFailed, ProcessLink, RemoteEngine
from .wire import EngineProcessSpec

__all__ = ["EngineProcess", "EngineProcessFailed", "EngineProcessSpec", "ProcessLink", "RemoteEngine"]
