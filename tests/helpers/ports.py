# Copyright 2026 The rpg_trl authors. Licensed under the Apache License, Version 2.0.
"""A free TCP port on the loopback interface, for the launchers and servers the tests start."""

import socket


def free_port() -> int:
    """A port that no process listens on now (the OS picks it); the caller binds it soon after."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]
