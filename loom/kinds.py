"""The seam between the generic server and each kind of deployment.

A kind (text, sequence, embedding, decision, ...) is one Kind object that its
service module exports. routes.KINDS lists them; registry.py iterates them and
never branches on a kind's name. What a kind says about itself:

    name                   the document's "kind"
    endpoint, routes       the path /v1/models advertises; every (method, path, handler) it serves
    inputs, outputs        its modalities, as /v1/models lists them
    probes                 (command, geometry) pairs compiled before the model is ready,
                           and again for every staged native variant
    trial(binding, c, g)   the probe's inputs and outputs, shaped as the engine sends them,
                           for its trial run in the proving ground (None: not trial-run)
    options(doc, options)  preparation options it derives from the document (the KV pool)
    extend(doc, o, path)   None, or a function adding tensors to the checkpoint before binding
                           (the image kind packs the document's LoRA adapters this way)
    server_files(doc, path) the server files it reads beyond the document's locators (confined)
    check(prepared)        raises a Problem when the prepared package cannot serve this kind
                           (the registration fails with its code and message)
    components(prepared)   its residency components ("primary", and e.g. "image")
    contracts              {component name: Component} a document may add to "primary" (the
                           text kind's "image"): each its own package and checkpoint, prepared,
                           checked and proven with the deployment
    capability(reg)        the fields it adds to the "loom" object of /v1/models
    start(reg, loop)       the engine (a scheduler.CohortEngine) serving the prepared registration

A request's life at a registration is a Job: the admission gate lets it start,
its client may leave (cancelled), unregister may withdraw it (fail), and its
device work ends (finish). Each service subclasses Job with its own work.
"""

from .errors import Error
from .http import Deferred, Response


class Derived:
    """What a kind's host side derives from a prepared deployment (a voice's settings, a
    model's tokenizer and scheduler), built once by cls(prepared) and kept with it."""

    @classmethod
    def of(cls, prepared):
        derived = prepared.__dict__.setdefault("derived", {})
        if cls not in derived:
            derived[cls] = cls(prepared)
        return derived[cls]


def seed(value, param="seed"):
    """A request's seed: an unsigned 64-bit integer or its decimal string (default 0)."""
    if value is None:
        return 0
    if isinstance(value, str):
        if not value.isdigit() or int(value) >= 2**64:
            raise Error(400, f"{param} must be an unsigned 64-bit integer or its decimal string, got {value!r}",
                        "invalid_value", param)
        return int(value)
    return value


class Component:
    """What a kind asks of an extra component's package (the document's "components"):
    the probes its stages compile and trial-run at, and check(primary, component), which
    raises a Problem when the two cannot serve together."""
    probes = ()
    inputs = ()         # the input modalities it adds to the deployment's

    def trial(self, binding, command, geometry):
        return None

    def check(self, primary, component):
        pass


class Kind:
    name = None
    endpoint = None
    routes = ()
    inputs, outputs = (), ()
    probes = ()
    contracts = {}

    def options(self, doc, options):
        return options

    def extend(self, doc, options, checkpoint_path):
        """None, or extend(checkpoint) -> (arrays, metadata): tensors computed from the
        document that the package binds like the checkpoint's own (see runtime.prepare)."""
        return None

    def server_files(self, doc, checkpoint_path):
        """(document field, server path) of the files it reads beyond the document's own
        locators (the image kind's LoRA adapters): registration confines them to the model roots."""
        return []

    def trial(self, binding, command, geometry):
        return None

    def check(self, prepared):
        pass

    def components(self, prepared):
        return ("primary",) + (tuple(prepared.components) if prepared is not None else ())

    def input_modalities(self, prepared):
        extra = [m for name in (prepared.components if prepared is not None else ())
                 for m in self.contracts[name].inputs]
        return list(self.inputs) + [m for m in extra if m not in self.inputs]

    def capability(self, reg):
        return {}

    def start(self, reg, loop):
        raise NotImplementedError


class Job:
    what = "request"
    resident = True     # start() needs the parameters on the device
    components = ()     # extra residency components it needs resident too (a chat's images: "image")

    def __init__(self, server, reg, request):
        self.server, self.reg, self.request = server, reg, request
        self.deferred = Deferred()
        self.deferred.on_cancel = self.cancelled
        self.gone = False        # the client left, or the response was already settled
        self.acquired = False
        self.finished = False
        request.state = "queued"

    @property
    def engine(self):
        return self.reg.engine

    def start(self, error):
        """The gate let the job through and the parameters are resident (or error)."""
        self.acquired = error is None and self.resident
        if error is not None or self.gone:
            self.finish(error=error)
            return
        self.request.state = "running"
        self.run()

    def run(self):
        raise NotImplementedError

    def cancelled(self):
        """The client disconnected: leave the queue; accepted device work retires for its peers."""
        self.gone = True
        self.server.registry.withdraw(self.reg, self)

    def fail(self, error):
        """Withdrawn (unregister): answer now; accepted device work still retires."""
        if not self.gone:
            self.gone = True
            self.deferred.resolve(Response.error(error))

    def finish(self, response=None, error=None):
        if self.finished:
            return    # several endings can race (a failure, then the retiring step): one counts
        self.finished = True
        self.server.registry.leave(self.reg, self, self.acquired)
        self.acquired = False
        if error is not None:
            response = Response.error(Error.of(error, self.what))
        if not self.gone and response is not None:
            self.deferred.resolve(response)
