"""The loader's errors: what failed after the headers were validated."""


class LoadError(RuntimeError):
    """Loading failed after the headers were validated (a read, a copy, a
    file that shrank).  ``path`` and ``tensor`` say where, where known;
    ``code`` is the errno or the runtime's error code."""

    def __init__(self, message, path=None, tensor=None, code=0):
        super().__init__(message)
        self.path = path
        self.tensor = tensor
        self.code = code

    def __reduce__(self):
        # Every attribute survives pickling (multi-rank loads send errors).
        return (type(self), (str(self), self.path, self.tensor, self.code))


class VerifyError(LoadError):
    """verify=True found a tensor whose memory differs from its file bytes."""
