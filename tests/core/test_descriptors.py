"""Descriptors are small typed values: kind tests, nesting, the text and identifiers every view
prints (unchanged from the string descriptors), and a structural round trip through the export codec."""
import pytest
import torch

import aotgrad
from aotgrad.errors import ExportFormatError
from aotgrad.store import codec, schema  # noqa: F401 - schema registers the classes with the codec
from aotgrad.ir.descriptors import (BaseDesc, BufferDesc, Desc, GradDesc, InputDesc, MutationDesc, OutputDesc,
                                    ParamDesc, SavedDesc, TangentDesc, ViewBaseDesc)

# (descriptor, str, ident): the texts and placeholder names the string descriptors gave.
CASES = [
    (ParamDesc("h.0.attn.weight"), "param 'h.0.attn.weight'", "p_h_0_attn_weight"),
    (BufferDesc("bn.running_mean"), "buffer 'bn.running_mean'", "b_bn_running_mean"),
    (InputDesc("kwargs['mask']"), "kwargs['mask']", "kwargs_mask"),
    (OutputDesc(0), "output 0", "out_0"),
    (TangentDesc(OutputDesc(1)), "tangent of output 1", "tangent_output_1"),
    (TangentDesc(MutationDesc(InputDesc("x"))), "tangent of new value of x", "tangent_new_value_of_x"),
    (GradDesc(ParamDesc("fc.weight")), "grad of param 'fc.weight'", "grad_param_fc_weight"),
    (MutationDesc(BufferDesc("b")), "new value of buffer 'b'", "new_buffer_b"),
    (BaseDesc((InputDesc("a"), InputDesc("b"))), "base of a, b", "base_a_b"),
    (ViewBaseDesc(2), "base of views 2", "base_views_2"),
    (TangentDesc(ViewBaseDesc(0)), "tangent of base of views 0", "tangent_base_of_views_0"),
    (SavedDesc("mm_1"), "saved mm_1", "saved_mm_1"),
    (InputDesc("???"), "???", "x"),
]


@pytest.mark.parametrize("desc, text, ident", CASES, ids=[c[1] for c in CASES])
def test_text_and_identifier_unchanged(desc, text, ident):
    assert str(desc) == text and desc.ident() == ident


@pytest.mark.parametrize("desc", [c[0] for c in CASES], ids=[c[1] for c in CASES])
def test_export_codec_round_trip_is_structural(desc):
    data = codec.encode(desc)
    assert data["@"] == type(desc).__name__
    back = codec.decode(data)
    assert back == desc and type(back) is type(desc) and hash(back) == hash(desc)


def test_nested_descriptors_are_encoded_as_data():
    assert codec.encode(GradDesc(of=ParamDesc("w"))) == {"@": "GradDesc", "of": {"@": "ParamDesc", "name": "w"}}


@pytest.mark.parametrize("data", [
    {"@": "Desc", "kind": "param", "name": "w"},                       # the version-1 form
    {"@": "ShellDesc", "name": "w"},
    {"@": "TangentDesc", "output": "output 0"},                         # a string where a descriptor goes
    {"@": "TangentDesc", "output": {"@": "ViewMeta", "size": {"tuple": []}, "stride": {"tuple": []}, "offset": 0}},
    {"@": "OutputDesc", "index": "0"},
    {"@": "BaseDesc", "members": [{"@": "InputDesc", "name": "a"}]},    # a list, not a tuple
])
def test_malformed_or_unknown_descriptor_is_a_format_error(data):
    with pytest.raises(ExportFormatError):
        codec.decode(data)


def test_kind_tests():
    p, b, x = ParamDesc("w"), BufferDesc("r"), InputDesc("x")
    assert p.is_param() and p.is_state() and not p.is_buffer() and not p.is_input()
    assert b.is_buffer() and b.is_state() and not b.is_param()
    assert x.is_input() and not x.is_state()
    assert OutputDesc(0).is_output() and TangentDesc(OutputDesc(0)).is_tangent()
    assert GradDesc(p).is_grad() and not GradDesc(p).is_param()
    assert not any(f(MutationDesc(p)) for f in (Desc.is_param, Desc.is_grad, Desc.is_output, Desc.is_tangent))
    assert ParamDesc("w") != BufferDesc("w")


class _Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(3, 2)
        self.bn = torch.nn.BatchNorm1d(2)

    def forward(self, x):
        return self.bn(self.fc(x)).pow(2).sum()


def test_joint_of_a_captured_module_is_described_by_typed_descriptors():
    torch.manual_seed(0)
    captured = aotgrad.capture(_Net(), torch.randn(4, 3))
    ins, outs = captured.input_descs, captured.output_descs
    assert ins[:2] == (ParamDesc("fc.weight"), ParamDesc("fc.bias"))
    assert BufferDesc("bn.running_mean") in ins and InputDesc("input 0") in ins
    assert TangentDesc(output=OutputDesc(0)) in ins
    assert GradDesc(of=ParamDesc("fc.weight")) in outs and GradDesc(of=ParamDesc("bn.weight")) in outs
    assert MutationDesc(of=BufferDesc("bn.running_mean")) in outs
    names = [n.name for n in captured.joint.graph.nodes if n.op == "placeholder"]
    assert names == [d.ident() for d in ins]
    assert [d for d in ins if d.is_state()] == [d for d in ins if d.is_param() or d.is_buffer()]
