"""The one error type, and the one table that gives lower layers' errors a status.

Every error body is {"error": {"message", "type", "param", "code"}} (DESIGN.md
"Errors"). Two classes carry it:

- Problem(message, code, param): what a lower layer raises (jsonin, packages,
  chat, scheduler, kvcache, runtime, device, audio, images). It knows no HTTP: a stable code
  says what went wrong, param which input was at fault.
- Error(status, message, code, param, headers): a service handler's rejection,
  with the status it decides. A Problem that reaches the service boundary
  (server.handle, a job's finish) becomes an Error through `of`, its status
  looked up in STATUS by its code. Nothing else maps errors to statuses.
"""

# The envelope's `type` follows the status family, as OpenAI clients expect.
ERROR_TYPES = {
    400: "invalid_request_error", 403: "permission_error", 404: "not_found_error", 405: "invalid_request_error",
    408: "timeout_error", 409: "conflict_error", 410: "gone_error", 411: "invalid_request_error",
    413: "invalid_request_error", 415: "invalid_request_error", 417: "invalid_request_error",
    422: "unprocessable_entity_error", 429: "rate_limit_error", 431: "invalid_request_error",
    500: "server_error", 501: "not_implemented_error", 503: "overloaded_error",
    505: "invalid_request_error",
}

# Lower layers' codes -> status. A code missing here is a server bug: 500.
STATUS = {
    # jsonin: the request is not the JSON the endpoint takes
    "invalid_json": 400, "duplicate_key": 400, "unknown_field": 400, "missing_field": 400,
    "invalid_type": 400, "out_of_range": 400, "invalid_value": 400, "unsupported_value": 400,
    # packages: uploaded source packages
    "invalid_filename": 400, "invalid_path": 400, "too_many_files": 400, "duplicate_field": 400,
    "duplicate_file": 400, "missing_filename": 400, "conflicting_file": 400, "missing_member": 422,
    # scheduler and kvcache: retained state
    "checkpoint_not_found": 404, "session_not_found": 404, "checkpoint_exists": 409, "session_busy": 409,
    "checkpoint_borrowed": 409, "checkpoint_capacity": 503, "fixed_backing": 400, "sequence_conflict": 409,
    "control_queue_full": 503,
    # device
    "device_memory": 503,
    "step_timeout": 503,
    "device_limit": 500,      # the package cannot run this geometry on this device
    # audio: uploaded recordings
    "unsupported_audio": 415, "audio_codec_disabled": 415, "invalid_audio": 400, "invalid_pcm_geometry": 400,
    "channel_mismatch": 400, "audio_too_long": 400, "resample_budget": 400,
    # image generation: a registration's adapters or scheduler the package cannot use
    "invalid_adapter": 422, "unsupported_scheduler": 422,
    # images: image parts' data URLs (malformed 400, unsupported or disabled 415, over a limit 413)
    "unsupported_image_url": 400, "invalid_image_url": 400, "invalid_image": 400, "image_mime_mismatch": 400,
    "unsupported_image": 415, "image_codec_disabled": 415, "animated_image": 415,
    "image_too_large": 413, "image_dimensions_too_large": 413, "image_too_many_pixels": 413,
    # phonemes: text for speech synthesis (espeak-ng)
    "phonemizer_unavailable": 503, "invalid_input": 400, "input_too_long": 400,
    "unsupported_voice": 422,
}


class Problem(Exception):
    """A lower layer's error: a message, a stable code, the parameter at fault.

    About the server's own files (sources, checkpoints, assets, includes) a message
    that reaches a client, /v1/status or /logz never repeats what the server read
    (PROFILES: the server has no authentication, so every diagnostic is public):
    `quotes` False says the message names only paths, positions and what was
    expected; `private`, when set, is the whole diagnostic, which only the server's
    standard error shows (logs.PRIVATE)."""

    code = "internal"
    quotes = True       # the message may hold text read from a file (withhold it for server files)

    def __init__(self, message, code=None, param=None, private=None, quotes=None):
        super().__init__(message)
        self.message = message
        self.code = code or type(self).code
        self.param = param
        self.private = private
        if quotes is not None:
            self.quotes = quotes


# What a withheld diagnostic says instead of the file's text.
WITHHELD = "the server repeats nothing it read from its files; its standard error has the whole diagnostic"


def withhold(error, public, cls=Problem, code=None):
    """A `cls` for an error about server files: `public`, which names only paths, positions
    and what was expected, with WITHHELD, as its message (or the error's own `public`
    rendering, when its reader gives one); the error's own text as its `private` detail.
    An error that quotes nothing (quotes False) keeps its message."""
    text = error.message if isinstance(error, Problem) else str(error) or type(error).__name__
    code = code or getattr(error, "code", None)
    param = getattr(error, "param", None)
    if not getattr(error, "quotes", True):
        return cls(text, code, param, getattr(error, "private", None), quotes=False)
    if getattr(error, "public", None):      # the reader's own rendering: its position and expectation
        return cls(f"{error.public} ({WITHHELD})", code, param, private=text, quotes=False)
    return cls(f"{public} ({WITHHELD})", code, param, private=text, quotes=False)


class Error(Problem):
    """A rejection with its HTTP status: becomes the error envelope."""

    def __init__(self, status, message, code=None, param=None, headers=()):
        super().__init__(message, code, param)
        self.status = status
        self.headers = list(headers)

    @classmethod
    def of(cls, problem, what=None):
        """The Error a raised exception answers with: itself, a Problem by its code,
        anything else a 500 (prefixed with `what` failed)."""
        if isinstance(problem, Error):
            return problem
        if isinstance(problem, Problem) and problem.code in STATUS:
            return cls(STATUS[problem.code], problem.message, problem.code, problem.param)
        message = getattr(problem, "message", None) or str(problem) or type(problem).__name__
        return cls(500, f"{what} failed: {message}" if what else message, "execution_failed")

    def envelope(self):
        return {"error": {"message": self.message, "type": ERROR_TYPES.get(self.status, "error"),
                          "param": self.param, "code": self.code}}
