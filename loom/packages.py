"""Uploaded source packages: multipart file parts as an immutable in-memory namespace.

Registration and native staging accept multipart/form-data with one `request` part
(the endpoint's JSON) and any number of `file` parts (programs and metadata). Each
filename is a case-sensitive, literal UTF-8 path inside the package, never a server
filesystem destination: the package is never written to disk, and references from
the request JSON are resolved against it lexically.

- `check_filename(name)`: the filename rules (one place, so parts and resolved
  references obey the same ones).
- `from_form(parts)`: the Package and the request JSON bytes.
- `Package.resolve(ref)` / `read(ref)`: a reference from the request JSON.
  Relative references resolve against the request file's directory and may use
  `..` inside the package but never above its root; a missing member fails (422)
  and never falls back to a server file. Absolute references explicitly name
  server-local files, which the caller reads.
- `Package.resolve_dir(ref)`: the same for a directory (an asset directory such
  as "."), whose files are then resolved with `resolve(name, base=directory)`.
"""

from types import MappingProxyType

from .errors import Problem


class PackageError(Problem):
    """A package, filename, reference or form that cannot be taken (errors.STATUS gives its status)."""


# Bounds (DESIGN: everything is bounded). The whole body is already bounded by
# --request_body_bytes; these bound the namespace itself.
MAX_FILES = 4096            # members, the request file included
MAX_NAME_BYTES = 1024       # UTF-8 bytes of one package path
MAX_COMPONENT_BYTES = 255   # UTF-8 bytes of one path component (the common filesystem limit)
MAX_DEPTH = 32              # components of one package path
MAX_REF_BYTES = 4096        # UTF-8 bytes of one reference (it may climb with many '..')

DEFAULT_REQUEST_FILENAME = "request.json"


def _shown(name):
    """A name for an error message: repr escapes control characters; huge names are abbreviated."""
    if len(name) <= 200:
        return repr(name)
    return f"{name[:200]!r}... ({len(name)} characters)"


def _text_problem(text):
    """Why `text` (a filename or reference) is unusable regardless of where it points, or None."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        # Lone surrogates: a str that is not UTF-8 (e.g. undecodable bytes smuggled in).
        return "is not valid UTF-8"
    for c in text:
        o = ord(c)
        if o < 0x20 or 0x7F <= o <= 0x9F:   # C0, DEL, C1 (Unicode category Cc)
            return f"contains control character U+{o:04X}"
    if "\\" in text:
        # A backslash is a Windows separator to the client that wrote it; guessing either
        # meaning could pick the wrong file.
        return "contains a backslash; package paths use '/' separators"
    if len(text) >= 2 and text[1] == ":" and text[0].isascii() and text[0].isalpha():
        return f"starts with the drive prefix {text[:2]!r}"
    return None


def _name_problem(name):
    """Why `name` is not a valid package path, or None. Valid paths are already normal:
    no component is empty, '.' or '..', so joining them never leaves the root."""
    if not isinstance(name, str):
        return f"must be a string, not {type(name).__name__}"
    if not name:
        return "is empty"
    problem = _text_problem(name)
    if problem:
        return problem
    if name.startswith("/"):
        return "is an absolute path; package paths are relative to the package root"
    if len(name.encode("utf-8")) > MAX_NAME_BYTES:
        return f"is longer than {MAX_NAME_BYTES} UTF-8 bytes"
    components = name.split("/")
    if len(components) > MAX_DEPTH:
        return f"has more than {MAX_DEPTH} components"
    for component in components:
        if component in ("", ".", ".."):
            what = "an empty component (leading, trailing or doubled '/')" if not component \
                else f"a {component!r} component"
            return f"has {what}"
        if len(component.encode("utf-8")) > MAX_COMPONENT_BYTES:
            return f"has a component longer than {MAX_COMPONENT_BYTES} UTF-8 bytes"
    return None


def check_filename(name):
    """`name` if it is a valid package filename, else Error 400 "invalid_filename".

    Literal: no URL-decoding, no Unicode normalization, no case folding, so the
    name a client sends is the name a reference must use."""
    problem = _name_problem(name)
    if problem:
        shown = _shown(name) if isinstance(name, str) else repr(type(name).__name__)
        raise PackageError(f"package filename {shown} {problem}", "invalid_filename")
    return name


class Package:
    """An immutable uploaded source package, held in memory independently of the request.

    files: normalized package path -> bytes (the request file included), read-only.
    request_path: the request part's filename; base: its directory ("" for the root).
    nbytes: total file bytes, for accounting the memory a retained package holds.
    """

    __slots__ = ("files", "request_path", "base", "nbytes", "_dirs")

    def __init__(self, files, request_path):
        # Validated here as well as in from_form so that every Package, however built,
        # satisfies the safety property: no member names anything outside the root.
        if len(files) > MAX_FILES:
            raise PackageError(f"package has {len(files)} files; at most {MAX_FILES} are allowed",
                            "too_many_files")
        owned = {}
        for name, data in files.items():
            check_filename(name)
            # Exact bytes objects are immutable and own their memory; anything else
            # (a view of a connection buffer, a bytearray) is copied.
            owned[name] = data if type(data) is bytes else bytes(data)
        if request_path not in owned:
            raise ValueError(f"request file {request_path!r} is not in the package")
        # Every directory implied by a member, "" (the root) included. A path that is both
        # a file and a directory cannot exist in a real tree; rejecting it keeps '..' and
        # directory references unambiguous.
        dirs = {""}
        for name in owned:
            parts = name.split("/")
            for i in range(1, len(parts)):
                dirs.add("/".join(parts[:i]))
        for name in owned:
            if name in dirs:
                inner = next(n for n in owned if n.startswith(name + "/"))
                raise PackageError(f"package filename {_shown(name)} is a file but {_shown(inner)} "
                                     "uses it as a directory", "conflicting_file")
        setattr_ = object.__setattr__
        setattr_(self, "files", MappingProxyType(owned))
        setattr_(self, "request_path", request_path)
        setattr_(self, "base", request_path.rpartition("/")[0])
        setattr_(self, "nbytes", sum(len(data) for data in owned.values()))
        setattr_(self, "_dirs", frozenset(dirs))

    def __setattr__(self, name, value):
        raise AttributeError("Package is immutable")

    def __delattr__(self, name):
        raise AttributeError("Package is immutable")

    def __repr__(self):
        return f"Package(request_path={self.request_path!r}, {len(self.files)} files, {self.nbytes} bytes)"

    # ---- references -----------------------------------------------------------------------------

    def _locate(self, ref, base, param, directory):
        """("server", path) or ("package", path) for `ref`, with every check except membership."""
        def reject(problem):
            shown = _shown(ref) if isinstance(ref, str) else repr(type(ref).__name__)
            raise PackageError(f"reference {shown} {problem}", "invalid_path", param)

        if not isinstance(ref, str):
            reject(f"must be a string, not {type(ref).__name__}")
        if not ref:
            reject("is empty")
        problem = _text_problem(ref)
        if problem:
            reject(problem)
        if len(ref.encode("utf-8")) > MAX_REF_BYTES:
            reject(f"is longer than {MAX_REF_BYTES} UTF-8 bytes")
        components = ref.split("/")
        if not directory and components[-1] in ("", ".", ".."):
            reject("names a directory, not a file")
        if ref.startswith("/"):
            # A server path: drop only what cannot change its meaning ('//' and '.').
            # '..' stays for the filesystem to resolve: collapsing it lexically would
            # disagree with the kernel whenever the component before it is a symlink.
            kept = [c for c in components if c not in ("", ".")]
            return "server", "/" + "/".join(kept)
        # A package path: lexical, since the package is a flat mapping with no symlinks.
        parts = base.split("/") if base else []
        for component in components:
            if component in ("", "."):
                continue
            if component == "..":
                if not parts:
                    reject(f"leaves the package root (resolved from {base + '/' if base else 'the root'})")
                parts.pop()
            else:
                parts.append(component)
        path = "/".join(parts)
        if path and _name_problem(path):
            reject(f"resolves to {_shown(path)}, which {_name_problem(path)}")
        return "package", path

    def _base(self, base):
        if base is None:
            return self.base
        if base not in self._dirs:
            raise ValueError(f"{base!r} is not a directory of this package")
        return base

    def resolve(self, ref, base=None, param=None):
        """("package", member path) or ("server", absolute path) for a file reference.

        Relative refs resolve against `base` (default: the request file's directory);
        `param` names the request field in errors. Invalid refs and refs escaping the
        root reject with 400 "invalid_path"; a package path that is not a member rejects
        with 422 "missing_member" and is never looked up on the server."""
        kind, path = self._locate(ref, self._base(base), param, directory=False)
        if kind == "package" and path not in self.files:
            what = "a directory" if path in self._dirs else "not in the uploaded package"
            raise PackageError(f"reference {_shown(ref)} resolves to package path {_shown(path)}, which is "
                                 f"{what}; relative references never fall back to server files "
                                 "(use an absolute path for a server-local file)", "missing_member", param)
        return kind, path

    def resolve_dir(self, ref, base=None, param=None):
        """("package", directory) ("" for the root) or ("server", absolute path) for a directory
        reference such as an asset directory "."; a package directory must contain a member."""
        kind, path = self._locate(ref, self._base(base), param, directory=True)
        if kind == "package" and path not in self._dirs:
            what = "a file" if path in self.files else "not a directory of the uploaded package"
            raise PackageError(f"directory reference {_shown(ref)} resolves to package path {_shown(path)}, "
                                 f"which is {what}", "missing_member", param)
        return kind, path

    def folder_of(self, ref, base=None, param=None):
        """The package directory a relative locator places metadata in: the locator
        itself when it names a directory ("." is the request's), else its parent; None
        when the package has no such directory (nothing uploaded there)."""
        kind, path = self._locate(ref, self._base(base), param, directory=True)
        if kind != "package":
            raise ValueError(f"{ref!r} is a server path")
        if path in self._dirs:
            return path
        parent = path.rpartition("/")[0]
        return parent if parent in self._dirs else None

    def reader(self, folder):
        """read(name) -> bytes | None for the files of one package directory."""
        return lambda name: self.files.get(f"{folder}/{name}" if folder else name)

    def read(self, ref, base=None, param=None):
        """("package", bytes) for a package member, or ("server", None) for a server path
        (the caller reads it with its own bounds)."""
        kind, path = self.resolve(ref, base, param)
        return kind, (self.files[path] if kind == "package" else None)


def from_form(parts, request_field="request", file_field="file"):
    """(Package, request JSON bytes) from parsed multipart parts.

    Exactly one `request_field` part (filename defaults to request.json), any number of
    `file_field` parts each with a filename, nothing else. The outcome does not depend
    on part order; duplicate filenames reject."""
    parts = list(parts)     # walked more than once
    for part in parts:
        if part.name not in (request_field, file_field):
            raise PackageError(f"unknown form field {part.name!r}; expected {request_field!r} and "
                                 f"{file_field!r} parts", "unknown_field", part.name)
    requests = [p for p in parts if p.name == request_field]
    if not requests:
        raise PackageError(f"missing form field {request_field!r} (the request JSON)", "missing_field",
                        request_field)
    if len(requests) > 1:
        raise PackageError(f"form field {request_field!r} appears {len(requests)} times; exactly one "
                             "request part is allowed", "duplicate_field", request_field)
    files = [p for p in parts if p.name == file_field]
    if len(files) + 1 > MAX_FILES:
        raise PackageError(f"package has {len(files) + 1} files; at most {MAX_FILES} are allowed",
                        "too_many_files", file_field)

    request = requests[0]
    request_path = DEFAULT_REQUEST_FILENAME if request.filename is None else request.filename
    _check_part_filename(request_path, request_field)
    members = {request_path: request.data}
    for part in files:
        if part.filename is None:
            raise PackageError(f"a {file_field!r} part has no filename; every file part names its "
                                 "package path (curl: -F 'file=@path;filename=dir/name')",
                            "missing_filename", file_field)
        _check_part_filename(part.filename, file_field)
        if part.filename in members:
            other = "the request part" if part.filename == request_path else "another file part"
            raise PackageError(f"package filename {_shown(part.filename)} is also used by {other}",
                            "duplicate_file", file_field)
        members[part.filename] = part.data
    package = Package(members, request_path)
    return package, package.files[request_path]


def _check_part_filename(name, field):
    try:
        check_filename(name)
    except PackageError as e:
        e.param = field
        raise
