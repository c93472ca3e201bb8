"""gguf_io against gguf.GGUFReader (the format's reference reader) on the real file."""
import numpy as np
from gguf import GGUFReader, GGUFValueType

from gguf_io import GGUFFile, read_params, read_vocab


def test_metadata_and_tensor_table_match_reference_reader(smollm_path):
    ours, ref = GGUFFile(smollm_path), GGUFReader(smollm_path)
    ref_keys = [k for k in ref.fields if not k.startswith("GGUF.")]
    assert list(ours.metadata) == ref_keys
    for key in ref_keys:
        field, mine = ref.fields[key], ours.metadata[key]
        assert mine.type == field.types[0], key
        if field.types[0] == GGUFValueType.ARRAY and field.types[-1] == GGUFValueType.STRING:
            assert mine.value == [bytes(field.parts[i]).decode() for i in field.data], key
        elif field.types[0] == GGUFValueType.ARRAY:
            assert np.array_equal(mine.value, field.contents()), key
        else:
            assert mine.value == field.contents(), key
    assert len(ours.tensors) == len(ref.tensors)
    for t in ref.tensors:
        mine = ours.tensors[t.name]
        assert (mine.type, list(mine.shape), mine.offset, mine.nbytes) == \
               (t.tensor_type, t.shape.tolist(), t.data_offset, t.n_bytes)
        assert np.array_equal(ours.tensor_bytes(t.name).reshape(-1), t.data.reshape(-1).view(np.uint8))


def test_params_and_vocab(smollm_path):
    f = GGUFFile(smollm_path)
    p = read_params(f)
    assert (p.arch, p.n_layer, p.n_embd, p.n_head, p.n_head_kv, p.head_dim, p.n_ff) == ("llama", 30, 576, 9, 3, 64, 1536)
    assert p.rope_base == 100000.0 and p.context_length == 8192
    v = read_vocab(f)
    assert (v.model, v.pre, len(v), v.bos_id, v.eos_id, v.add_bos) == ("gpt2", "smollm", 49152, 1, 2, False)
    assert v.tokens[v.eos_id] == "<|im_end|>" and v.eos_id in v.end_of_generation


def test_tensor_views_are_zero_copy(smollm_path):
    f = GGUFFile(smollm_path)
    view = f.tensor_bytes("blk.0.attn_q.weight")
    assert not view.flags.owndata and not view.flags.writeable
