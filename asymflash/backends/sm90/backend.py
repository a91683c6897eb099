"""The sm90 backend as dispatch sees it: the Gluon forward and backward."""

from __future__ import annotations

from .bwd.host import backward, backward_runner, unsupported_backward  # noqa: F401 - the backend protocol
from .fwd.host import forward, forward_runner, unsupported  # noqa: F401 - the backend protocol

NAME = "sm90"
