"""Uploaded source packages (loom.packages): filename rules, form parts, reference resolution.

The property tests check the safety contract against posixpath as an independent
oracle: no accepted filename and no relative reference names anything outside the
package root, and relative references never become server paths.
"""

import itertools
import posixpath

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from loom._native import multipart, pymultipart
from loom.errors import Error
from loom.packages import (MAX_COMPONENT_BYTES, MAX_DEPTH, MAX_FILES, MAX_NAME_BYTES, Package, PackageError,
                           check_filename, from_form)

FUZZ = settings(max_examples=400, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])
Part = multipart.Part


def fpart(name, filename, data=b""):
    return Part(name, filename, [], None, {}, data)


def rejects(status, code, fn, *args, **kwargs):
    with pytest.raises(PackageError) as info:
        fn(*args, **kwargs)
    error = Error.of(info.value)          # the status the service boundary gives it
    assert (error.status, error.code) == (status, code), error.message
    return error


def pkg(*names, request="request.json"):
    return Package({request: b"{}", **{n: n.encode("utf-8", "surrogatepass") for n in names}}, request)


# ---- filenames --------------------------------------------------------------------------------

ACCEPTED = [
    "request.json", "config.loom", "model/candidate.json", "model/config.loom", "a/b/c/d.loombc",
    "modèle/ü.loom", "模型/配置.loom", "emoji/🙂.loom", "%41", "model/%2e%2e/x",  # literal, not URL-decoded
    "A.loom", "a.loom", "...", "..a", "a..", ".hidden", "a/.b", "ab:y", "ab:", "a/C:x", "1:x", "~/x", "a b/c d",
    "café\u0301",                      # combining mark: literal, not normalized
    "a\u200bb", "\u00a0",              # format/space characters are not control characters
    "x" * MAX_COMPONENT_BYTES, "/".join(["d"] * MAX_DEPTH),
    "/".join(["y" * 200] * 5)[:MAX_NAME_BYTES],
]

REJECTED = [
    ("", "empty"), ("/abs", "absolute"), ("/", "absolute"), ("//server/share", "absolute"),
    ("a//b", "empty component"), ("a/", "empty component"), ("/a", "absolute"),
    (".", "'.' component"), ("./a", "'.' component"), ("a/.", "'.' component"), ("a/./b", "'.' component"),
    ("..", "'..' component"), ("../a", "'..' component"), ("a/..", "'..' component"),
    ("model/../x", "'..' component"),
    ("a\\b", "backslash"), ("\\a", "backslash"), ("..\\a", "backslash"), ("\\\\server\\share", "backslash"),
    ("C:x", "drive prefix"), ("c:foo", "drive prefix"), ("x:y", "drive prefix"), ("C:", "drive prefix"),
    ("z:/a", "drive prefix"),
    ("a\x00b", "U+0000"), ("\x00", "U+0000"), ("a\nb", "U+000A"), ("a\rb", "U+000D"), ("a\tb", "U+0009"),
    ("\x1f", "U+001F"), ("a\x7fb", "U+007F"), ("a\x80", "U+0080"), ("a\u0085b", "U+0085"), ("\x9f", "U+009F"),
    ("a\ud800b", "not valid UTF-8"), ("\udcff", "not valid UTF-8"),
    ("x" * (MAX_COMPONENT_BYTES + 1), "component longer"),
    ("é" * 128, "component longer"),                          # 256 UTF-8 bytes, 128 characters
    ("/".join(["d"] * (MAX_DEPTH + 1)), "more than"),
    ("/".join(["y" * 200] * 6), "longer than"),
]


@pytest.mark.parametrize("name", ACCEPTED)
def test_accepted_filenames(name):
    assert check_filename(name) is name


@pytest.mark.parametrize("name,reason", REJECTED)
def test_rejected_filenames(name, reason):
    e = rejects(400, "invalid_filename", check_filename, name)
    assert reason in e.message
    assert repr(name)[:40] in e.message          # names the offending filename, control chars escaped
    assert not any(ord(c) < 0x20 for c in e.message)


@pytest.mark.parametrize("name", [None, b"a", 1])
def test_non_string_filenames_reject(name):
    rejects(400, "invalid_filename", check_filename, name)


def test_filenames_are_case_sensitive_and_literal():
    p = pkg("A.loom", "a.loom", "café", "cafe\u0301", "%41")
    assert p.read("A.loom") == ("package", b"A.loom")
    assert p.read("a.loom") == ("package", b"a.loom")
    assert p.read("café")[1] != p.read("cafe\u0301")[1]
    assert p.resolve("%41") == ("package", "%41")
    rejects(422, "missing_member", p.resolve, "A")


def test_huge_name_message_is_bounded():
    e = rejects(400, "invalid_filename", check_filename, "x" * 100_000)
    assert len(e.message) < 500 and "100000 characters" in e.message


# ---- from_form --------------------------------------------------------------------------------

def test_from_form_default_request_filename():
    package, request = from_form([fpart("request", None, b'{"model":"scout"}'), fpart("file", "a.loom", b"A")])
    assert request == b'{"model":"scout"}'
    assert package.request_path == "request.json" and package.base == ""
    assert dict(package.files) == {"request.json": b'{"model":"scout"}', "a.loom": b"A"}
    assert package.nbytes == len(request) + 1


def test_from_form_request_filename_sets_base():
    package, request = from_form([
        fpart("file", "model/config.loom", b"C"), fpart("request", "model/candidate.json", b"{}"),
        fpart("file", "model/advance.loombc", b"\x00LOOMBC\xff"), fpart("file", "shared/y.loom", b"Y")])
    assert request == b"{}"
    assert package.request_path == "model/candidate.json" and package.base == "model"
    assert package.read("config.loom") == ("package", b"C")
    assert package.read("advance.loombc") == ("package", b"\x00LOOMBC\xff")
    assert package.read("../shared/y.loom") == ("package", b"Y")


def test_from_form_only_request():
    package, request = from_form([fpart("request", "r.json", b"{}")])
    assert dict(package.files) == {"r.json": b"{}"}


def test_from_form_custom_field_names():
    package, _ = from_form([fpart("doc", None, b"{}"), fpart("src", "a", b"")], request_field="doc",
                           file_field="src")
    assert set(package.files) == {"request.json", "a"}
    e = rejects(400, "unknown_field", from_form, [fpart("doc", None), fpart("file", "a")], "doc", "src")
    assert e.param == "file"


def test_part_order_does_not_matter():
    parts = [fpart("request", "m/r.json", b"{}"), fpart("file", "m/a", b"1"), fpart("file", "b", b"2"),
             fpart("file", "m/c/d", b"3")]
    results = {tuple(sorted(from_form(list(order))[0].files.items())) for order in itertools.permutations(parts)}
    assert len(results) == 1


@pytest.mark.parametrize("parts,param", [
    ([fpart("file", "a")], "request"),
    ([], "request"),
])
def test_missing_request(parts, param):
    assert rejects(400, "missing_field", from_form, parts).param == param


def test_two_request_parts():
    e = rejects(400, "duplicate_field", from_form, [fpart("request", None), fpart("file", "a"),
                                                    fpart("request", "other.json")])
    assert e.param == "request" and "2 times" in e.message


@pytest.mark.parametrize("name", ["model", "files", "File", "request.json", ""])
def test_unknown_part(name):
    e = rejects(400, "unknown_field", from_form, [fpart("request", None), fpart(name, "x")])
    assert e.param == name and repr(name) in e.message


def test_unknown_part_rejects_regardless_of_position():
    rejects(400, "unknown_field", from_form, [fpart("other", None), fpart("request", None)])
    rejects(400, "unknown_field", from_form, [fpart("request", None), fpart("request", None), fpart("x", None)])


def test_file_part_without_filename():
    e = rejects(400, "missing_filename", from_form, [fpart("request", None), fpart("file", None, b"x")])
    assert e.param == "file"


@pytest.mark.parametrize("parts", [
    [fpart("request", None), fpart("file", "a"), fpart("file", "a")],
    [fpart("request", None), fpart("file", "request.json")],
    [fpart("file", "m/r.json"), fpart("request", "m/r.json")],
    [fpart("request", None), fpart("file", "x/y", b"1"), fpart("file", "x/y", b"1")],
])
def test_duplicate_filenames(parts):
    e = rejects(400, "duplicate_file", from_form, parts)
    assert e.param == "file"


def test_case_variants_are_not_duplicates():
    package, _ = from_form([fpart("request", None), fpart("file", "A.loom"), fpart("file", "a.loom")])
    assert set(package.files) == {"request.json", "A.loom", "a.loom"}


@pytest.mark.parametrize("field,filename", [
    ("file", "/etc/passwd"), ("file", "../x"), ("file", "a\\b"), ("file", "C:x"), ("file", ""),
    ("file", "a\x00"), ("request", "/abs.json"), ("request", "model/../r.json"), ("request", ""),
    ("file", "a\udc80"),
])
def test_form_filename_rules(field, filename):
    parts = [fpart("request", filename if field == "request" else None)]
    if field == "file":
        parts.append(fpart("file", filename))
    e = rejects(400, "invalid_filename", from_form, parts)
    assert e.param == field


def test_file_that_is_also_a_directory():
    e = rejects(400, "conflicting_file", from_form, [fpart("request", None), fpart("file", "a"),
                                                      fpart("file", "a/b")])
    assert "'a'" in e.message and "'a/b'" in e.message
    rejects(400, "conflicting_file", from_form, [fpart("request", "m"), fpart("file", "m/x")])


def test_file_count_is_bounded():
    parts = [fpart("request", None)] + [fpart("file", f"f{i}") for i in range(MAX_FILES - 1)]
    assert len(from_form(parts)[0].files) == MAX_FILES
    parts.append(fpart("file", "one-more"))
    rejects(400, "too_many_files", from_form, parts)


def test_bytes_are_owned_and_package_is_immutable():
    buffer = bytearray(b"payload")
    package = Package({"request.json": b"{}", "a": memoryview(buffer)}, "request.json")
    buffer[:] = b"changed"
    assert package.files["a"] == b"payload" and type(package.files["a"]) is bytes
    data = b"exact"
    package = Package({"request.json": data}, "request.json")
    assert package.files["request.json"] is data          # immutable bytes are kept, not copied
    with pytest.raises(TypeError):
        package.files["b"] = b"x"
    with pytest.raises(AttributeError):
        package.base = "elsewhere"
    with pytest.raises(AttributeError):
        package.extra = 1


def test_real_multipart_body_from_the_curl_example():
    boundary = "------------------------d74496d66958873e"
    sections = [
        ("request", "model/candidate.json", "application/json",
         b'{"model":"scout","base":12,"sources":["config.loom","advance.loombc"]}'),
        ("file", "model/config.loom", "application/octet-stream", b"kernel k() {}\n"),
        ("file", "model/advance.loombc", "application/octet-stream", b"LMBC\x00\x01\r\n--\xff"),
    ]
    body = b"".join(
        f'--{boundary}\r\nContent-Disposition: form-data; name="{n}"; filename="{f}"\r\n'
        f"Content-Type: {t}\r\n\r\n".encode() + d + b"\r\n" for n, f, t, d in sections) + f"--{boundary}--\r\n".encode()
    for impl in (multipart, pymultipart):
        parts = impl.parse(body, f"multipart/form-data; boundary={boundary}")
        package, request = from_form(parts)
        assert request == sections[0][3]
        assert [package.read(s) for s in ("config.loom", "advance.loombc")] == \
            [("package", sections[1][3]), ("package", sections[2][3])]


# ---- resolve ----------------------------------------------------------------------------------

SHARED = pkg("model/x.loom", "model/sub/k.loom", "shared/y.loom", "top.loom", request="model/candidate.json")


@pytest.mark.parametrize("ref,path", [
    ("x.loom", "model/x.loom"),
    ("./x.loom", "model/x.loom"),
    ("sub/k.loom", "model/sub/k.loom"),
    ("sub//k.loom", "model/sub/k.loom"),
    ("sub/../x.loom", "model/x.loom"),
    ("../shared/y.loom", "shared/y.loom"),
    ("../top.loom", "top.loom"),
    ("../model/sub/../../shared/./y.loom", "shared/y.loom"),
    ("candidate.json", "model/candidate.json"),
    ("missing/../x.loom", "model/x.loom"),          # lexical: the package has no directories to stat
])
def test_resolve_relative(ref, path):
    assert SHARED.resolve(ref) == ("package", path)
    assert SHARED.read(ref) == ("package", SHARED.files[path])


@pytest.mark.parametrize("ref", ["../../x", "..", "../..", "../../model/x.loom", "sub/../../../shared/y.loom",
                                 "../" * 50 + "etc/passwd"])
def test_resolve_escape_rejects(ref):
    e = rejects(400, "invalid_path", SHARED.resolve, ref, param="sources[0]")
    assert e.param == "sources[0]"


def test_resolve_escape_from_root():
    p = pkg("a.loom")
    rejects(400, "invalid_path", p.resolve, "../a.loom")
    rejects(400, "invalid_path", p.resolve, "x/../../a.loom")   # dips above the root, then returns


@pytest.mark.parametrize("ref,reason", [
    ("", "empty"), ("a\\b", "backslash"), ("..\\x", "backslash"), ("C:x", "drive prefix"), ("c:/x", "drive"),
    ("a\x00", "U+0000"), ("a\x1b", "U+001B"), ("a\u0085", "U+0085"), ("a\ud800", "UTF-8"),
    ("sub/", "directory"), ("sub/.", "directory"), (".", "directory"), ("sub/..", "directory"),
    ("/srv/x/", "directory"), ("/", "directory"), ("/srv/\x00", "U+0000"), ("/srv\\x", "backslash"),
    ("a" * 300, "component longer"), ("x/" * 40 + "y", "more than"), ("x" * 5000, "longer than 4096"),
    (7, "string"), (None, "string"), (["a"], "string"),
])
def test_resolve_invalid_refs(ref, reason):
    e = rejects(400, "invalid_path", SHARED.resolve, ref)
    assert reason in e.message


@pytest.mark.parametrize("ref", ["missing.loom", "X.loom", "shared/y.loom", "../shared/z.loom", "sub",
                                 "../model", "%78.loom"])
def test_resolve_missing_member_never_falls_back(ref, tmp_path, monkeypatch):
    # Even when a server file of that name exists in the working directory, nothing is read from it.
    (tmp_path / "missing.loom").write_text("server file")
    monkeypatch.chdir(tmp_path)
    e = rejects(422, "missing_member", SHARED.resolve, ref, param="sources[1]")
    assert e.param == "sources[1]" and "never fall back" in e.message
    rejects(422, "missing_member", SHARED.read, ref)


def test_missing_directory_is_named():
    e = rejects(422, "missing_member", SHARED.resolve, "sub")
    assert "a directory" in e.message


@pytest.mark.parametrize("ref,path", [
    ("/srv/models/scout/config.loom", "/srv/models/scout/config.loom"),
    ("//srv//x/./y.loom", "/srv/x/y.loom"),
    ("/srv/link/../x.loom", "/srv/link/../x.loom"),     # '..' is the filesystem's (symlinks)
    ("/x.loom", "/x.loom"),
    ("/model/x.loom", "/model/x.loom"),                 # same name as a member: still the server's
    ("/modèle/ü.loom", "/modèle/ü.loom"),
])
def test_resolve_absolute_is_server(ref, path):
    assert SHARED.resolve(ref) == ("server", path)
    assert SHARED.read(ref) == ("server", None)


def test_resolve_dir_and_base():
    assert SHARED.resolve_dir(".") == ("package", "model")
    assert SHARED.resolve_dir("..") == ("package", "")
    assert SHARED.resolve_dir("sub/") == ("package", "model/sub")
    assert SHARED.resolve_dir("/srv/assets/.") == ("server", "/srv/assets")
    assert SHARED.resolve_dir("/") == ("server", "/")
    rejects(400, "invalid_path", SHARED.resolve_dir, "../..")
    rejects(422, "missing_member", SHARED.resolve_dir, "nothing")
    rejects(422, "missing_member", SHARED.resolve_dir, "x.loom")       # a file, not a directory
    _, directory = SHARED.resolve_dir("../shared")
    assert SHARED.read("y.loom", base=directory) == ("package", b"shared/y.loom")
    assert SHARED.resolve("../top.loom", base="shared") == ("package", "top.loom")
    rejects(400, "invalid_path", SHARED.resolve, "../x", base="")
    with pytest.raises(ValueError):
        SHARED.resolve("x", base="not/a/dir")


# ---- properties -------------------------------------------------------------------------------

TOKENS = ["/", ".", "..", "\\", ":", "C:", "a", "b", "é", "模", "🙂", "\x00", "\n", "\x7f", "\x85", "\ud800",
          " ", "%2e", "~"]
names = st.lists(st.sampled_from(TOKENS) | st.text(max_size=3), max_size=12).map("".join)


def _inside_root_and_normal(name):
    normal = posixpath.normpath(name)
    return (normal == name and not posixpath.isabs(name) and normal != ".."
            and not normal.startswith("../") and normal != ".")


@FUZZ
@given(names)
def test_property_accepted_filenames_are_normal_and_inside_root(name):
    try:
        accepted = check_filename(name)
    except PackageError as p:
        e = Error.of(p)   # the status the service boundary gives it
        assert (e.status, e.code) == (400, "invalid_filename")
        return
    assert accepted == name
    assert _inside_root_and_normal(name)
    assert all(c not in ("", ".", "..") for c in name.split("/"))
    assert "\\" not in name and not any(ord(c) < 0x20 or 0x7F <= ord(c) <= 0x9F for c in name)
    name.encode("utf-8")


component = st.sampled_from(["a", "b", "c", "é", "模", "x.loom", "...", ".h", "A"])
member = st.lists(component, min_size=1, max_size=4).map("/".join)
ref_token = st.sampled_from(["..", "..", "..", ".", "", "a", "b", "c", "x.loom", "é", "A"])
relative_ref = st.lists(ref_token, min_size=1, max_size=10).map("/".join).filter(lambda r: not r.startswith("/"))


@st.composite
def package_and_refs(draw):
    files = {}
    for name in draw(st.lists(member, min_size=1, max_size=12, unique=True)):
        # Keep the package a tree: no member may also be another member's directory.
        if not any(name.startswith(f + "/") or f.startswith(name + "/") for f in files):
            files[name] = name.encode()
    request = draw(st.sampled_from(sorted(files)))
    # Refs aimed at members ('..' up some levels, harmless noise, then a member path) hit
    # members, directories and escapes; random token refs cover everything else.
    aimed = st.builds(lambda ups, noise, target: "/".join([".."] * ups + noise + [target]),
                      st.integers(0, 5), st.lists(st.sampled_from([".", "", "a/..", "b/c/../.."]), max_size=3),
                      st.sampled_from(sorted(files))).filter(lambda r: not r.startswith("/"))
    return Package(files, request), draw(st.lists(aimed | relative_ref, min_size=1, max_size=8))


@FUZZ
@given(package_and_refs())
def test_property_relative_refs_stay_inside_the_package(case):
    package, refs = case
    for ref in refs:
        oracle = posixpath.normpath(posixpath.join(package.base, ref))
        escapes = oracle == ".." or oracle.startswith("../")
        names_dir = ref.split("/")[-1] in ("", ".", "..")
        try:
            kind, path = package.resolve(ref)
        except PackageError as p:
            e = Error.of(p)   # the status the service boundary gives it
            if e.status == 400:
                assert e.code == "invalid_path" and (escapes or names_dir)
            else:
                # (3) a resolved package path is a member, or the call raised 422
                assert (e.status, e.code) == (422, "missing_member")
                assert not escapes and oracle not in package.files
            continue
        # (2) a relative reference is never a server path and never leaves the root
        assert kind == "package"
        assert path in package.files
        assert path == oracle and not escapes
        assert check_filename(path) == path
        assert package.read(ref) == ("package", path.encode())


@FUZZ
@given(package_and_refs(), names)
def test_property_arbitrary_refs_never_escape(case, ref):
    package, _ = case
    try:
        kind, path = package.resolve(ref)
    except PackageError as p:
        e = Error.of(p)   # the status the service boundary gives it
        assert (e.status, e.code) in ((400, "invalid_path"), (422, "missing_member"))
        return
    if ref.startswith("/"):
        assert kind == "server" and path.startswith("/") and "\x00" not in path
    else:
        assert kind == "package" and path in package.files and _inside_root_and_normal(path)


@FUZZ
@given(st.lists(member, min_size=1, max_size=8, unique=True), st.randoms(use_true_random=False))
def test_property_from_form_is_order_independent(names_, rnd):
    names_ = [n for n in names_ if not any(n != m and (n.startswith(m + "/") or m.startswith(n + "/"))
                                           for m in names_)]
    parts = [fpart("request", None, b"{}")] + [fpart("file", n, n.encode()) for n in names_ if n != "request.json"]
    shuffled = list(parts)
    rnd.shuffle(shuffled)
    assert dict(from_form(parts)[0].files) == dict(from_form(shuffled)[0].files)
