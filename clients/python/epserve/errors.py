"""The client's error, a leaf the other modules import."""


class EpserveError(Exception):
    """A call that failed: `code` is the grpc.StatusCode, `details` the service's message."""

    def __init__(self, code, details):
        self.code, self.details = code, details
        super().__init__(f"{code.name}: {details}")
