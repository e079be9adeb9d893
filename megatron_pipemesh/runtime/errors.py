"""The runtime's error type (shared by the executor and its transports)."""


class PipeMeshRuntimeError(RuntimeError):
    """A failure while running a plan; the message names rank, step and op."""
