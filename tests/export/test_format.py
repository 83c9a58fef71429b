"""The artifact as a file: what loading refuses (crafted, mismatched, truncated, corrupted files)
and what it keeps (values, guards, refusals at export time)."""
import hashlib
import json
import os
import pickle
import zipfile

import pytest
import torch
import torch.nn as nn

import aotgrad
from aotgrad.errors import ExportFormatError, InputMismatchError, UnsupportedError
from aotgrad.store.manifest import VERSION


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 3)
        self.bn = nn.BatchNorm1d(3)

    def forward(self, x, scale: float = 2.0):
        return (self.bn(self.lin(x)) * scale).relu().sum()


@pytest.fixture(scope="module")
def artifact(tmp_path_factory):
    torch.manual_seed(0)
    net, x = Net(), torch.randn(5, 4)
    path = str(tmp_path_factory.mktemp("fmt") / "net.aotgrad")
    aotgrad.capture(net, x, 3.0).export(path)
    return path, net, x


def _rewrite(src, dst, edit):
    """Copy the zip ``src`` to ``dst``, passing each member's bytes through ``edit(name, data)``."""
    with zipfile.ZipFile(src) as z, zipfile.ZipFile(dst, "w") as out:
        for name in z.namelist():
            out.writestr(name, edit(name, z.read(name)))
    return dst


def _edit_json(member, change):
    def edit(name, data):
        if name != member:
            return data
        obj = json.loads(data)
        change(obj)
        return json.dumps(obj).encode()
    return edit


def test_loads_and_matches_eager(artifact):
    path, net, x = artifact
    step = aotgrad.load(path)
    assert "\n" not in repr(step) and "4 parameters, 3 buffers" in repr(step)
    ref = Net()
    ref.load_state_dict(net.state_dict())
    got, want = step(x, 3.0), ref(x, 3.0)
    got.backward()
    want.backward()
    torch.testing.assert_close(got, want)
    for (n, p), (_, q) in zip(step.named_parameters(), ref.named_parameters()):
        torch.testing.assert_close(p.grad, q.grad, msg=n)
    for (n, b), (_, c) in zip(step.named_buffers(), ref.named_buffers()):
        torch.testing.assert_close(b, c, msg=n)          # running statistics updated in place


def test_guards_and_constants_still_checked(artifact):
    path, _, x = artifact
    step = aotgrad.load(path)
    with pytest.raises(InputMismatchError, match="size.*export one per input shape"):
        step(torch.randn(6, 4), 3.0)
    with pytest.raises(InputMismatchError, match="3.0"):
        step(x, 4.0)


class _Doubling(torch.overrides.TorchFunctionMode):
    """A torch function mode that changes what ``relu`` computes: eager under it gives other numbers."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        return out * 2 if func in (torch.relu, torch.Tensor.relu) else out


def test_torch_function_modes_a_loaded_step_cannot_enter(artifact, tmp_path):
    """A loaded step's graph calls the operators, which no torch function mode intercepts: a call
    under one is refused (it ran the graph before, where eager doubles); a capture traced under one is
    not exported."""
    path, net, x = artifact
    step = aotgrad.load(path)
    with _Doubling(), pytest.raises(InputMismatchError, match="torch function modes"):
        step(x, 3.0)
    step(x, 3.0)        # outside it, as captured
    with _Doubling(), pytest.raises(UnsupportedError, match="traced under torch function modes"):
        aotgrad.capture(net, x, 3.0).export(str(tmp_path / "moded.aotgrad"))


def test_values_left_out_are_taken_from_state(artifact, tmp_path):
    path, net, x = artifact
    bare = str(tmp_path / "bare.aotgrad")
    aotgrad.capture(net, x, 3.0).export(bare, values=False)
    with pytest.raises(ExportFormatError, match="state="):
        aotgrad.load(bare)
    with pytest.raises(ExportFormatError, match="size"):
        aotgrad.load(bare, state={**net.state_dict(), "lin.weight": torch.zeros(2, 2)})
    step = aotgrad.load(bare, state=net.state_dict())
    torch.testing.assert_close(step(x, 3.0), aotgrad.load(path)(x, 3.0))
    assert os.path.getsize(bare) < os.path.getsize(path)


@pytest.mark.parametrize("target", [{"py": "os.system"}, {"py": "builtins.eval"}, {"py": "builtins.getattr"},
                                    {"py": "_operator.methodcaller"}, {"op": "os::system.default"},
                                    {"op": "aten::__class__.default"}, {"op": "aotgrad::tensor_hook.default"}])
def test_crafted_target_is_refused_and_nothing_runs(artifact, tmp_path, target):
    path, _, _ = artifact
    marker = tmp_path / "pwned"

    def change(graph):
        node = next(n for n in graph["nodes"] if n[0] == "call_function")
        node[2], node[3] = target, {"tuple": [f"touch {marker}"]}
    crafted = _rewrite(path, str(tmp_path / "crafted.aotgrad"), _edit_json("graphs/joint.json", change))
    with pytest.raises(ExportFormatError, match="nothing was run|does not exist"):
        aotgrad.load(crafted)
    assert not marker.exists()


class _Payload:
    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


@pytest.mark.parametrize("member, same_size", [("manifest.json", False), ("graphs/joint.json", False),
                                               ("tensors.bin", False), ("tensors.bin", True)])
def test_pickle_payload_is_never_unpickled(artifact, tmp_path, monkeypatch, member, same_size):
    """``same_size``: the payload padded to the member's own size, so only the manifest's digest tells
    it apart (the marker is a short relative path, so the payload fits on every machine)."""
    path, _, _ = artifact
    monkeypatch.chdir(tmp_path)
    payload = _Payload()
    payload.marker = "pwned"
    data = pickle.dumps(payload)
    if same_size:
        size = zipfile.ZipFile(path).getinfo(member).file_size
        assert len(data) <= size, "the payload must fit the member to test the same-size case"
        data = data + b"." * (size - len(data))     # pickle stops at its STOP opcode: the padding is inert
    crafted = _rewrite(path, str(tmp_path / "crafted.aotgrad"), lambda name, d: data if name == member else d)
    with pytest.raises(ExportFormatError):
        aotgrad.load(crafted)
    assert not (tmp_path / payload.marker).exists()


@pytest.mark.parametrize("change, message", [
    (lambda m: m.update(version=VERSION + 1), "format version"),
    (lambda m: m.update(torch="1.9.0"), "torch 1.9.0"),
    (lambda m: m.update(format="something-else"), "not an aotgrad export"),
    (lambda m: m["ops"].update({next(iter(m["ops"])): "aten::made_up(Tensor self) -> Tensor"}), "schema"),
    (lambda m: m["analysis"].update({"@": "Popen"}), "class"),
    (lambda m: m["input_descs"][0].update({"@": "ShellDesc"}), "class"),
    (lambda m: m["input_descs"].__setitem__(0, {"@": "Desc", "kind": "param", "name": "w"}), "class"),   # version 1
    (lambda m: m["output_descs"][-1].update({"of": "param 'lin.weight'"}), "GradDesc.of"),
    (lambda m: m.pop("layout"), "lacks layout"),
    (lambda m: m["tensors"][next(iter(m["tensors"]))].update(nbytes=10 ** 9), "corrupted or truncated"),
])
def test_incompatible_or_malformed_manifest(artifact, tmp_path, change, message):
    path, _, _ = artifact
    crafted = _rewrite(path, str(tmp_path / "m.aotgrad"), _edit_json("manifest.json", change))
    with pytest.raises(ExportFormatError, match=message):
        aotgrad.load(crafted)


def test_truncated_and_corrupted_files(artifact, tmp_path):
    path, _, _ = artifact
    data = open(path, "rb").read()
    for cut in (0, 10, len(data) // 2, len(data) - 1):
        (tmp_path / "t.aotgrad").write_bytes(data[:cut])
        with pytest.raises(ExportFormatError, match="corrupted or truncated|not a readable"):
            aotgrad.load(str(tmp_path / "t.aotgrad"))
    with zipfile.ZipFile(path) as z:
        info = z.getinfo("tensors.bin")
    flipped = bytearray(data)
    at = info.header_offset + 30 + len(info.filename) + info.compress_size // 2
    flipped[at] ^= 0xFF
    (tmp_path / "c.aotgrad").write_bytes(bytes(flipped))
    with pytest.raises(ExportFormatError):
        aotgrad.load(str(tmp_path / "c.aotgrad"))
    with pytest.raises(ExportFormatError, match="cannot read"):
        aotgrad.load(str(tmp_path / "missing.aotgrad"))


def test_dynamic_capture_is_refused_at_export(tmp_path):
    captured = aotgrad.capture(lambda x: (x * 2).sum(), torch.randn(3, requires_grad=True), dynamic=True)
    with pytest.raises(UnsupportedError, match="symbolic sizes"):
        captured.export(str(tmp_path / "d.aotgrad"))
    assert not (tmp_path / "d.aotgrad").exists()


def test_object_argument_is_refused_at_export(tmp_path):
    marker = object()
    captured = aotgrad.capture(lambda x, tag: (x * 2).sum(), torch.randn(3, requires_grad=True), marker)
    with pytest.raises(UnsupportedError, match="non-tensor argument of type object"):
        captured.export(str(tmp_path / "o.aotgrad"))


def test_create_graph_through_exported_step_is_refused(artifact):
    path, _, x = artifact
    step = aotgrad.load(path)
    loss = step(x, 3.0)
    with pytest.raises(UnsupportedError, match="create_graph=True through an exported step"):
        torch.autograd.grad(loss, list(step.parameters()), create_graph=True)


def _inject(marker):
    return f"__import__('os').system('touch {marker}')"


@pytest.mark.parametrize("where", ["kwarg key", "dict arg", "guard requires_grad", "guard size", "output kind",
                                   "layout count", "step name"])
def test_text_that_would_become_code_is_refused(artifact, tmp_path, where):
    """Graph kwargs, guard specs and metadata reach generated Python source: only values of the
    exact type the runtime builds are accepted, so no text from the file is pasted into code."""
    path, _, x = artifact
    marker = tmp_path / "pwned"
    code = _inject(marker)

    def graph(g):
        node = next(n for n in g["nodes"] if n[0] == "call_function")
        if where == "kwarg key":
            node[4] = {"dict": {f"x={code}, y": 1}}
        else:
            node[3] = {"tuple": [{"dict": {code: 1}}]}

    def manifest(m):
        if where == "guard requires_grad":
            m["guards"][0]["requires_grad"] = f"True or {code}"
        elif where == "guard size":
            m["guards"][0]["size"] = {"tuple": [f"1 or {code}"]}
        elif where == "output kind":
            m["analysis"]["outputs"]["tuple"][0]["kind"] = code
        elif where == "layout count":
            m["layout"]["n_primals"] = code
        else:
            m["name"] = f"f(): pass\n{code}\ndef g"
    member, change = ("graphs/joint.json", graph) if where in ("kwarg key", "dict arg") else ("manifest.json", manifest)
    crafted = _rewrite(path, str(tmp_path / "inj.aotgrad"), _edit_json(member, change))
    if where == "step name":            # not an identifier: the step is named "exported"
        aotgrad.load(crafted)(x, 3.0)
    else:
        with pytest.raises(ExportFormatError):
            aotgrad.load(crafted)(x, 3.0)
    assert not marker.exists()


def _paths(obj, path=()):
    yield path
    items = obj.items() if isinstance(obj, dict) else enumerate(obj) if isinstance(obj, list) else ()
    for k, v in items:
        yield from _paths(v, path + (k,))


def test_any_changed_manifest_field_loads_or_is_refused(artifact, tmp_path):
    """60 seeded random edits of one manifest field each: loading gives a step or an
    ExportFormatError, never another exception."""
    import random
    path, _, _ = artifact
    rng = random.Random(0)
    with zipfile.ZipFile(path) as z:
        manifest = json.loads(z.read("manifest.json"))
    fields = [p for p in _paths(manifest) if p]
    for _ in range(60):
        where, value = rng.choice(fields), rng.choice([None, -1, 10 ** 12, 1.5, "x", [], {}, {"tuple": [1]},
                                                       {"@": "Desc"}, True, {"device": "device"}])

        def change(m):
            for k in where[:-1]:
                m = m[k]
            m[where[-1]] = value
        crafted = _rewrite(path, str(tmp_path / "f.aotgrad"), _edit_json("manifest.json", change))
        try:
            aotgrad.load(crafted)
        except ExportFormatError:
            pass


def test_loaded_graphs_keep_node_values(artifact, tmp_path):
    """Shapes and dtypes of every node travel as data: memory estimates and printed tables match a fresh compile."""
    path, net, x = artifact
    step = aotgrad.load(path)
    fresh = aotgrad.capture(net, x, 3.0).compile()
    assert step.compiled.memory.saved_bytes == fresh.memory.saved_bytes > 0
    assert "param 'lin.weight' float32[3, 4]" in str(step)

    def change(g):
        name = next(iter(g["values"]))
        g["values"][name]["shape"] = {"tuple": ["s0 + __import__('os').getpid()"]}
    crafted = _rewrite(path, str(tmp_path / "v.aotgrad"), _edit_json("graphs/forward.json", change))
    with pytest.raises(ExportFormatError, match="TensorMeta.shape"):
        aotgrad.load(crafted)


def test_output_class_pytree_cannot_name_is_refused_at_export(tmp_path):
    import collections
    pair = collections.namedtuple("Pair", "loss extra")
    captured = aotgrad.capture(lambda x: pair(x.sin().sum(), x.cos()), torch.randn(3, requires_grad=True))
    with pytest.raises(UnsupportedError, match="output structure .*Pair"):
        captured.export(str(tmp_path / "p.aotgrad"))


def _insert_call(path, dst, graph, nodes, table=True):
    """``path`` with ``nodes`` (``[name, op, args, kwargs]``) inserted before ``graph``'s output, and
    (``table``) the manifest's operator table made to list them with this torch's schemas."""
    def edit(name, data):
        if name == f"graphs/{graph}.json":
            g = json.loads(data)
            g["nodes"][-1:-1] = [["call_function", n, {"op": op}, {"tuple": args}, {"dict": kwargs}]
                                 for n, op, args, kwargs in nodes]
            return json.dumps(g).encode()
        if name == "manifest.json" and table:
            m = json.loads(data)
            for _, op, _, _ in nodes:
                ns, _, rest = op.partition("::")
                base, _, overload = rest.partition(".")
                m["ops"][op] = str(getattr(getattr(getattr(torch.ops, ns), base), overload)._schema)
            return json.dumps(m).encode()
        return data
    return _rewrite(path, dst, edit)


@pytest.mark.parametrize("graph", ["forward", "joint"])
@pytest.mark.parametrize("table", [True, False])
def test_graph_writing_a_file_is_refused(artifact, tmp_path, graph, table):
    """``from_file(path, shared=True)`` maps a file; copying a value into it writes the file."""
    path, _, x = artifact
    victim, existing = tmp_path / "pwned", tmp_path / "existing"
    existing.write_bytes(b"keep")
    for target in (victim, existing):
        crafted = _insert_call(path, str(tmp_path / "ff.aotgrad"), graph, [
            ("ff", "aten::from_file.default", [str(target), True, 4], {"dtype": {"dtype": "float32"}}),
            ("cp", "aten::copy_.default", [{"node": "ff"}, {"node": "ff"}], {})], table)
        with pytest.raises(ExportFormatError, match="from_file.*(file name|not one the format allows)"
                           if table else "operator table|from_file"):
            aotgrad.load(crafted)(x, 3.0)
    assert not victim.exists() and existing.read_bytes() == b"keep"


@pytest.mark.parametrize("op, args, why", [
    ("aten::_print.default", ["hi"], "returns nothing"),
    ("aten::set_.source_Tensor", [{"node": "input_0"}, {"node": "input_0"}], "writes one of its arguments"),
    ("aten::resize_.default", [{"node": "input_0"}, [100]], "writes one of its arguments"),
    ("aten::save.default", [{"node": "input_0"}, "x.pt"], "TorchScript builtin"),
    ("aten::_unsafe_index.Tensor", [{"node": "input_0"}, [None]], "skips its index checks"),
    ("aotgrad::block_fw.default", [[{"node": "input_0"}], 0, 0], "only while capturing"),
    ("aotgrad::set_rng_state.default", [{"node": "input_0"}, {"device": "cpu"}], "does not allow"),   # a chosen state
])
def test_operators_outside_the_allowlist_are_refused_at_load(artifact, tmp_path, op, args, why):
    path, _, x = artifact
    crafted = _insert_call(path, str(tmp_path / "op.aotgrad"), "forward", [("bad", op, args, {})])
    with pytest.raises(ExportFormatError, match=why):
        aotgrad.load(crafted)
    assert not (tmp_path / "x.pt").exists()


def test_allowlist_rule():
    from aotgrad.store.sandbox import refusal
    aten = torch.ops.aten
    for op in (aten.mm.default, aten.addmm.default, aten.div.Tensor_mode, aten.gelu.default, aten.bernoulli.p,
               aten._local_scalar_dense.default, aten._unsafe_view.default, aten.empty_like.default,
               torch.ops.prims.convert_element_type.default, torch.ops.aotgrad.rng_state.default,
               aten._linalg_check_errors.default):
        assert refusal(op) is None, op
    for op in (aten.from_file.default, aten.copy_.default, aten.add_.Tensor, aten.mm.out, aten.set.source_Storage,
               aten._functional_assert_async.msg, aten._assert_async.default, aten.grad.default,
               aten.get_gradients.default, aten._sparse_coo_tensor_with_dims_and_tensors.default,
               torch.ops.aotgrad.tensor_hook.default, torch.ops.aotgrad.block_bw.default, operator_getattr()):
        assert refusal(op) is not None, op


def test_linalg_step_loads_and_raises_eagers_error_on_a_singular_matrix(tmp_path):
    """``linalg.inv`` traces a check that only raises (``_linalg_check_errors``): the artifact keeps
    it, so a singular matrix raises eager's LinAlgError in the loaded step instead of returning inf."""
    def f(a, b):
        return (torch.linalg.inv(a) @ b).sum()
    torch.manual_seed(0)
    a, b = torch.randn(3, 3, requires_grad=True), torch.randn(3, 2)
    path = str(tmp_path / "inv.aotgrad")
    aotgrad.capture(f, a, b).export(path)
    step = aotgrad.load(path)
    got, want = step(a, b), f(a, b)
    got.backward()
    g, a.grad = a.grad, None
    want.backward()
    assert torch.allclose(got, want) and torch.allclose(g, a.grad)
    singular = torch.zeros(3, 3, requires_grad=True)
    with pytest.raises(torch.linalg.LinAlgError) as eager:
        f(singular, b)
    with pytest.raises(torch.linalg.LinAlgError) as loaded:
        step(singular, b)
    assert str(loaded.value) == str(eager.value)


def operator_getattr():
    import operator
    return operator.attrgetter


def test_operator_table_must_list_exactly_the_graphs_operators(artifact, tmp_path):
    path, _, _ = artifact
    extra = _rewrite(path, str(tmp_path / "t.aotgrad"), _edit_json(
        "manifest.json", lambda m: m["ops"].update({"aten::sin.default": str(torch.ops.aten.sin.default._schema)})))
    with pytest.raises(ExportFormatError, match="operator table"):
        aotgrad.load(extra)
    crafted = _insert_call(path, str(tmp_path / "u.aotgrad"), "forward",
                           [("s", "aten::sin.default", [{"node": "input_0"}], {})], table=False)
    with pytest.raises(ExportFormatError, match="operator table"):
        aotgrad.load(crafted)


def test_consistently_edited_parameter_shape_is_refused_at_load(artifact, tmp_path):
    """lin.weight (3, 4) -> (4, 4) in the state and guard tables, the tensor table and bytes and the
    graphs' recorded inputs: the graphs' own values no longer follow, so loading refuses it."""
    path, _, x = artifact
    blob = zipfile.ZipFile(path).read("tensors.bin")
    blob = blob[:48] + bytes(16) + blob[48:]

    def edit(name, data):
        if name == "tensors.bin":
            return blob
        doc = json.loads(data)
        if name == "manifest.json":
            doc["tensors_sha256"] = hashlib.sha256(blob).hexdigest()
            doc["state"][0]["shape"] = [4, 4]
            doc["guards"][0]["size"] = {"tuple": [4, 4]}
            for k, e in doc["tensors"].items():
                if k == "state/lin.weight":
                    e.update(shape=[4, 4], nbytes=64)
                elif e["start"] > 0:
                    e["start"] += 16
        elif "p_lin_weight" in doc["values"]:
            doc["values"]["p_lin_weight"]["shape"] = {"tuple": [4, 4]}
        return json.dumps(doc).encode()
    crafted = _rewrite(path, str(tmp_path / "s.aotgrad"), edit)
    with pytest.raises(ExportFormatError, match="p_lin_weight|recorded as|cannot run"):
        aotgrad.load(crafted)


@pytest.mark.parametrize("entry", ["../x", "extra.txt", "duplicate", "symlink"])
def test_zip_members_outside_the_format_are_refused(artifact, tmp_path, entry):
    import stat
    path, _, _ = artifact
    dst = str(tmp_path / "z.aotgrad")
    with zipfile.ZipFile(path) as z, zipfile.ZipFile(dst, "w") as out:
        for name in z.namelist():
            info = zipfile.ZipInfo(name)
            if entry == "symlink" and name == "tensors.bin":
                info.external_attr = (stat.S_IFLNK | 0o777) << 16
            out.writestr(info, z.read(name))
        if entry in ("../x", "extra.txt"):
            out.writestr(entry, b"x")
        elif entry == "duplicate":
            with pytest.warns(UserWarning):
                out.writestr("manifest.json", b"{}")
    with pytest.raises(ExportFormatError, match="members"):
        aotgrad.load(dst)
    assert not (tmp_path.parent / "x").exists()


@pytest.mark.parametrize("fn, args, kwargs", [("pow", [10, 100000000], {}), ("neg", [{"node": "input_0"}, 1], {}),
                                             ("pow", ["x", 2.0], {}), ("pow", [2.0, 3.0], {"modulo": 5}),
                                             ("mul", [[1], 2.0], {})])
def test_crafted_arithmetic_is_refused(artifact, tmp_path, fn, args, kwargs):
    """A training step's scalar arithmetic (``operator.pow`` on an ``.item()``) is admitted on numbers
    only, and a power only with a float constant: ``10 ** 100000000`` in integers would never end."""
    path, _, x = artifact

    def edit(name, data):
        if name == "graphs/forward.json":
            g = json.loads(data)
            g["nodes"][-1:-1] = [["call_function", "bad", {"py": f"_operator.{fn}"}, {"tuple": args},
                                  {"dict": kwargs}]]
            return json.dumps(g).encode()
        return data
    crafted = _rewrite(path, str(tmp_path / "pow.aotgrad"), edit)
    with pytest.raises(ExportFormatError, match="on something other than one or two numbers"):
        aotgrad.load(crafted)


def test_an_output_returned_again_may_name_any_earlier_output_of_its_own():
    """An output that is an earlier output again (a view of a parameter returned twice: ``input_view``,
    then ``output``) loads; one naming itself, a later output or another repeat is refused. (The
    loader used to admit repeats of plain outputs only, and refused the step it had just exported.)"""
    from dataclasses import replace

    from aotgrad.export.verify import _check_analysis

    class Twice(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.randn(3, 3))

        def forward(self, x):
            rows = self.w[1:]
            return rows, (x @ self.w).sum(), rows
    with torch.no_grad():
        captured = aotgrad.capture(Twice(), torch.randn(4, 3))
    a, lay = captured.analysis, captured.layout
    fw = [None] * lay.n_fw
    assert [(o.kind, o.index) for o in a.outputs] == [("input_view", 0), ("plain", -1), ("output", 0)]

    def with_last(kind, index):
        return replace(a, outputs=(*a.outputs[:2], replace(a.outputs[2], kind=kind, index=index)))
    for ok in (0, 1):
        _check_analysis(with_last("output", ok), lay, None, fw)
    for bad in (2, 3, -1):
        with pytest.raises(ExportFormatError):
            _check_analysis(with_last("output", bad), lay, None, fw)


def test_operator_without_meta_kernel_loads_and_its_recorded_value_is_still_checked(tmp_path):
    """``multi_margin_loss_backward`` has no meta kernel: the loader computes its value with its real
    kernel on zeros of the verified shapes (as capture did), so the artifact loads and trains like
    eager, and a recorded value edited in every graph that holds it is still refused."""
    def f(x, t):
        return torch.nn.functional.multi_margin_loss(x, t)
    torch.manual_seed(0)
    x, t = torch.randn(4, 5, requires_grad=True), torch.tensor([0, 3, 1, 4])
    path = str(tmp_path / "mm.aotgrad")
    aotgrad.capture(f, x, t).export(path)
    step = aotgrad.load(path)
    got, want = step(x, t), f(x, t)
    got.backward()
    g, x.grad = x.grad, None
    want.backward()
    torch.testing.assert_close(got, want)
    torch.testing.assert_close(g, x.grad)

    def edit(name, data):
        if not name.startswith("graphs/"):
            return data
        g = json.loads(data)
        for node in g["nodes"]:
            if node[0] == "call_function" and "multi_margin_loss_backward" in json.dumps(node[2]):
                g["values"][node[1]]["shape"] = {"tuple": [5, 4]}
        return json.dumps(g).encode()
    crafted = _rewrite(path, str(tmp_path / "mm2.aotgrad"), edit)
    with pytest.raises(ExportFormatError, match="multi_margin_loss_backward"):
        aotgrad.load(crafted)


def test_backward_input_of_data_dependent_size_is_refused_at_export(tmp_path):
    """The backward takes ``x[idx]``'s index, of a size only ``nonzero`` decides: the format records no
    value for it, so the artifact would never load. Refused when exported, naming the input."""
    def f(x, w, m):
        idx = torch.nonzero(m).squeeze(1)
        return (x[idx] * w).exp().sum()
    x, w, m = torch.randn(6, 3), torch.randn(3, requires_grad=True), torch.arange(6) % 2 == 0
    with pytest.raises(UnsupportedError, match=r"size depends on data \(`index` of size \(u0, 3\)"):
        aotgrad.capture(f, x, w, m).export(str(tmp_path / "dd.aotgrad"))
