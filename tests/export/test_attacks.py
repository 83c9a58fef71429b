"""Op-level attacks on the loader (docs/export-format.md, "Loading is safe by construction"): a real
artifact's graph edited to call an operator that takes sizes, strides, offsets or index tensors with
crafted values, with the operator table made to agree. Each must be refused at load with an
``ExportFormatError`` (or, for a kernel whose indices only the data decides, raise one as it runs),
never read or write outside a storage: the files are loaded in a child process, so a crash is a
failure, not a lost test run. Also: zip members that inflate past their bound, a whole step's
manifest fields flipped one by one, and honest models using explicitly strided views, which
export, load and train like eager."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import zipfile

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import aotgrad
from aotgrad.errors import ExportFormatError
from tests.eager_check import check_training

B = 10 ** 6
X = {"node": "X"}               # the graph's input x (2, 1, 4, 4), renamed below
IDX = {"node": "idx"}           # an int64 index tensor [0, 1000000, 1] the attack builds first
_IDX = ["call_function", "idx", {"op": "aten::tensor.int"}, {"tuple": [B]}, {"dict": {}}]
_IDX3 = ["call_function", "idx", {"op": "aten::full.default"}, {"tuple": [[3], B]},
         {"dict": {"dtype": {"dtype": "int64"}}}]
# label -> (operator, args, kwargs): each takes sizes, strides, offsets or indices as arguments.
ATTACKS = {
    "reshape_alias": ("aten::_reshape_alias.default", [X, [2, 16], [B, 1]], {}),
    "reshape_alias_negative_stride": ("aten::_reshape_alias.default", [X, [2, 2], [-16, 1]], {}),
    "reshape_alias_copy": ("aten::_reshape_alias_copy.default", [X, [2, 16], [B, 1]], {}),
    "as_strided": ("aten::as_strided.default", [X, [2, 16], [B, 1]], {}),
    "as_strided_offset": ("aten::as_strided.default", [X, [2], [1], B], {}),
    "as_strided_copy": ("aten::as_strided_copy.default", [X, [2, 16], [B, 1]], {}),
    "as_strided_scatter": ("aten::as_strided_scatter.default", [X, X, [2, 1, 4, 4], [B, 16, 4, 1], 0], {}),
    "prims_as_strided_scatter": ("prims::as_strided_scatter.default", [X, X, [2, 1, 4, 4], [B, 16, 4, 1], 0], {}),
    "coo_to_csr": ("aten::_convert_indices_from_coo_to_csr.default", [IDX, 2], {}),
    "csr_to_coo": ("aten::_convert_indices_from_csr_to_coo.default", [IDX, IDX], {}),
    "segment_reduce": ("aten::segment_reduce.default", [X, "sum"], {"lengths": IDX, "unsafe": True}),
    "ctc_loss": ("aten::_ctc_loss.default", [X, IDX, [B], [2], 0, False], {}),
    "embedding_bag_backward": ("aten::_embedding_bag_per_sample_weights_backward.default",
                               [X, X, IDX, IDX, IDX, 0], {}),
    "pack_padded": ("aten::_pack_padded_sequence.default", [X, IDX, False], {}),
    "zerotensor": ("aten::_efficientzerotensor.default", [[B]], {}),
    "sparse_empty": ("aten::empty.memory_format", [[4]], {"layout": {"layout": "sparse_coo"}}),
    "quantized": ("aten::quantize_per_tensor.default", [X, 0.1, 0, {"dtype": "qint8"}], {}),
    "mkldnn": ("aten::to_mkldnn.default", [X], {}),
    "unsafe_index": ("aten::_unsafe_index.Tensor", [X, [IDX]], {}),
    "narrow_copy": ("aten::narrow_copy.default", [X, 0, 1, B], {}),
    "unfold": ("aten::unfold.default", [X, 3, B, 1], {}),
}
# Bounded by their kernels (an empty diagonal; select's index check; an allocation that fits its strides):
# they load, and running them raises a typed error or computes, never crashes.
BOUNDED = {
    "diagonal_copy": ("aten::diagonal_copy.default", [X, B, 2, 3], {}),
    "select_scatter": ("aten::select_scatter.default", [X, X, 0, B], {}),
    "new_empty_strided_negative": ("aten::new_empty_strided.default", [X, [2, 2], [-1, 1]], {}),
}


class Pool(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(1, 2, 1)

    def forward(self, x):
        return F.max_pool2d(self.conv(x), 2).square().sum()


def _schema(name: str) -> str:
    ns, _, rest = name.partition("::")
    base, _, overload = rest.partition(".")
    return str(getattr(getattr(getattr(torch.ops, ns), base), overload)._schema)


@pytest.fixture(scope="module")
def pool_artifact(tmp_path_factory):
    torch.manual_seed(0)
    path = str(tmp_path_factory.mktemp("attacks") / "pool.aotgrad")
    aotgrad.capture(Pool(), torch.randn(2, 1, 4, 4)).export(path)
    with zipfile.ZipFile(path) as z:
        return {i.filename: z.read(i.filename) for i in z.infolist()}


def _write(path, members: dict, docs: dict) -> str:
    with zipfile.ZipFile(path, "w", compression=zipfile.ZIP_DEFLATED) as z:
        for name, data in members.items():
            z.writestr(name, json.dumps(docs[name]).encode() if name in docs else data)
    return str(path)


def _edit(members: dict, graph: str, nodes: list, before: str | None = None):
    """The artifact with ``nodes`` inserted into ``graph`` (before the node ``before``, else before the
    output), ``X`` renamed to the graph's input x, and the operator table listing what they call."""
    docs = {n: json.loads(d) for n, d in members.items() if n.endswith(".json")}
    g = docs[f"graphs/{graph}.json"]
    x = next(n[1] for n in g["nodes"] if n[0] == "placeholder" and g["values"][n[1]]["shape"] == {"tuple": [2, 1, 4, 4]})
    text = json.dumps(nodes).replace('{"node": "X"}', json.dumps({"node": x}))
    at = next(i for i, n in enumerate(g["nodes"]) if n[1] == before or (before is None and n[0] == "output"))
    g["nodes"][at:at] = json.loads(text)
    for n in json.loads(text):
        docs["manifest.json"]["ops"][n[2]["op"]] = _schema(n[2]["op"])
    return docs


def _in_child(tmp_path, jobs: list) -> dict:
    """Each job's outcome, loaded (and run) in a child process; a crash names the job it died in."""
    jobs_path = tmp_path / "jobs.json"
    jobs_path.write_text(json.dumps(jobs))
    child = os.path.join(os.path.dirname(__file__), "attack_child.py")
    run = subprocess.run([sys.executable, child, str(jobs_path)], capture_output=True, text=True, timeout=300,
                         cwd=tmp_path, env={**os.environ, "PYTHONPATH": os.path.dirname(os.path.dirname(
                             os.path.dirname(os.path.abspath(__file__))))})
    lines = [json.loads(line) for line in run.stdout.splitlines() if line.startswith("{")]
    outcomes = {d["label"]: d["outcome"] for d in lines}
    assert run.returncode == 0, f"the child died (rc {run.returncode}) in {lines[-1] if lines else None}: " \
                                f"{run.stderr[-2000:]}"
    return outcomes


def test_crafted_operator_arguments_are_refused_at_load(pool_artifact, tmp_path):
    jobs = []
    for label, (op, args, kwargs) in {**ATTACKS, **BOUNDED}.items():
        uses_idx = "idx" in json.dumps([args, kwargs])
        node = ["call_function", "attack", {"op": op}, {"tuple": args}, {"dict": kwargs}]
        pre = [_IDX3 if op != "aten::_convert_indices_from_csr_to_coo.default" else _IDX3] if uses_idx else []
        docs = _edit(pool_artifact, "forward", pre + [node])
        jobs.append({"label": label, "path": _write(tmp_path / f"{label}.aotgrad", pool_artifact, docs),
                     "run": [[2, 1, 4, 4]] if label in BOUNDED else None})
    outcomes = _in_child(tmp_path, jobs)      # the child did not crash
    wrong = {k: v for k, v in outcomes.items() if not v.startswith("refused") and k in ATTACKS
             or v.startswith("untyped")}
    assert not wrong, wrong
    assert "outside" in outcomes["reshape_alias"] and "attack" in outcomes["reshape_alias"]


def test_unchecked_indices_raise_as_the_step_runs(pool_artifact, tmp_path):
    """max_pool2d's backward writes where its indices say: indices the graph shifts out of the plane
    raise a typed error before the kernel runs (it wrote past the gradient's storage)."""
    docs = {n: json.loads(d) for n, d in pool_artifact.items() if n.endswith(".json")}
    node = next(n for n in docs["graphs/backward.json"]["nodes"]
                if n[2] == {"op": "aten::max_pool2d_with_indices_backward.default"})
    jobs = []
    for label, shift in (("shifted", B), ("negative", -B), ("one_past", 4)):
        edited = _edit(pool_artifact, "backward", [["call_function", "evil", {"op": "aten::add.Tensor"},
                                                    {"tuple": [node[3]["tuple"][7], shift]}, {"dict": {}}]],
                       before=node[1])
        bw = edited["graphs/backward.json"]
        next(n for n in bw["nodes"] if n[1] == node[1])[3]["tuple"][7] = {"node": "evil"}
        jobs.append({"label": label, "path": _write(tmp_path / f"{label}.aotgrad", pool_artifact, edited),
                     "run": [[2, 1, 4, 4]]})
    jobs.append({"label": "honest", "path": _write(tmp_path / "honest.aotgrad", pool_artifact, {}), "run": [[2, 1, 4, 4]]})
    outcomes = _in_child(tmp_path, jobs)
    assert outcomes["honest"] == "loaded", outcomes["honest"]
    for label in ("shifted", "negative", "one_past"):
        assert outcomes[label].startswith("refused") and "outside [0, 16)" in outcomes[label], outcomes[label]


# --- zip members that inflate past their bound ---------------------------------------------------

def test_zip_bomb_member_is_refused_before_it_is_inflated(pool_artifact, tmp_path):
    from aotgrad.store import manifest
    docs = {"manifest.json": json.loads(pool_artifact["manifest.json"])}
    docs["manifest.json"]["name"] = " " * (manifest.JSON_LIMIT + 1)     # inflates past the bound
    path = _write(tmp_path / "bomb.aotgrad", pool_artifact, docs)
    assert os.path.getsize(path) < manifest.JSON_LIMIT // 100
    with pytest.raises(ExportFormatError, match="manifest.json inflates to"):
        aotgrad.load(path)


def test_tensors_member_larger_than_its_table_is_never_read(pool_artifact, tmp_path):
    members = dict(pool_artifact, **{"tensors.bin": pool_artifact["tensors.bin"] + bytes(1 << 24)})
    with pytest.raises(ExportFormatError, match="holds .* bytes, its tensor table"):
        aotgrad.load(_write(tmp_path / "big.aotgrad", members, {}))


def test_a_header_that_lies_about_the_size_inflates_no_more(pool_artifact, tmp_path, monkeypatch):
    """A header saying fewer bytes than the member inflates to: reading stops at the bound."""
    from aotgrad.store import manifest
    monkeypatch.setattr(manifest, "JSON_LIMIT", 1000)
    docs = {"graphs/joint.json": json.loads(pool_artifact["graphs/joint.json"])}
    path = _write(tmp_path / "lie.aotgrad", pool_artifact, docs)
    with zipfile.ZipFile(path) as z:
        info = z.getinfo("graphs/joint.json")
        info.file_size = 10      # as a crafted central directory would say
        with pytest.raises((ExportFormatError, zipfile.BadZipFile)):
            manifest.read_entry(z, "graphs/joint.json", json=True, limit=1000)
    with pytest.raises(ExportFormatError, match="json inflates to"):
        aotgrad.load(path)


# --- a whole step's manifest fields --------------------------------------------------------------

def _sgd_step(tmp_path, tensor_lr: bool):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2))
    lr = torch.tensor(0.1, dtype=torch.float64) if tensor_lr else 0.1
    opt = torch.optim.SGD([{"params": model[0].parameters()}, {"params": model[1].parameters(), "lr": lr}],
                          lr=lr, momentum=0.9)

    def train_step(x):
        loss = model(x).square().sum()
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss
    x = torch.randn(5, 3)
    train_step(x)
    path = str(tmp_path / f"sgd_{tensor_lr}.aotgrad")
    aotgrad.capture(train_step, x).export(path)
    with zipfile.ZipFile(path) as z:
        return {i.filename: z.read(i.filename) for i in z.infolist()}


def _flips(m: dict) -> dict:
    """label -> a function editing the manifest's step entry: each field the loader uses."""
    def group(i):
        return m["step"]["optimizers"][0]["groups"][i]
    return {"tensor_lr 0": lambda: group(0).update(tensor_lr=not group(0)["tensor_lr"]),
            "tensor_lr 1": lambda: group(1).update(tensor_lr=not group(1)["tensor_lr"]),
            "tensor_lr text": lambda: group(0).update(tensor_lr="false"),
            "params swapped in a group": lambda: group(0)["params"].reverse(),
            "groups swapped": lambda: m["step"]["optimizers"][0]["groups"].reverse(),
            "class": lambda: m["step"]["optimizers"][0].update({"class": "Adam", "module": "torch.optim.adam"}),
            "module": lambda: m["step"]["optimizers"][0].update(module="torch.optim.adam"),
            "key": lambda: m["step"]["optimizers"][0].update(key="SGD1"),
            "parameters order": lambda: m["step"]["parameters"].reverse(),
            "group dropped": lambda: m["step"]["optimizers"][0]["groups"].pop()}


@pytest.mark.parametrize("tensor_lr", [False, True])
def test_whole_step_manifest_fields_flipped_are_refused(tmp_path, tensor_lr):
    members = _sgd_step(tmp_path, tensor_lr)
    aotgrad.load(_write(tmp_path / "plain.aotgrad", members, {}))      # the unedited file loads
    labels = _flips(json.loads(members["manifest.json"]))
    for label in labels:
        m = json.loads(members["manifest.json"])
        _flips(m)[label]()
        with pytest.raises(ExportFormatError):
            aotgrad.load(_write(tmp_path / "f.aotgrad", members, {"manifest.json": m}))
            pytest.fail(f"{label} loaded")


# --- honest models using explicitly strided views --------------------------------------------------

class Strided(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 6)

    def forward(self, x):
        h = self.lin(x)                                                # (3, 6)
        window = torch.as_strided(h, (3, 2, 3), (6, 3, 1), 0)          # within h's storage
        tail = h.as_strided((2, 3), (6, 1), 3)                         # offset into it
        return window.sum(1).tanh().sum() + tail.square().sum() + torch.ops.aten._reshape_alias(h, (18,), (1,)).mean()


def test_honest_strided_views_export_load_and_train_like_eager(tmp_path):
    torch.manual_seed(0)
    x = torch.randn(3, 4)
    path = str(tmp_path / "strided.aotgrad")
    aotgrad.capture(Strided(), x).export(path)
    step = aotgrad.load(path)

    def make():
        if not made:
            model = Strided()
            model.load_state_dict(step.state_dict())
            made.append(model)
            return model, (x.clone(),)
        return step, (x.clone(),)
    made: list = []
    check_training(make, steps=3, compile=lambda fn, args, kwargs: fn)
