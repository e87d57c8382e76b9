"""asyncrl.single_controller.batch.Batch: columns, row operations, padding and the wire format."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from asyncrl.single_controller.batch import EXT_BATCH, Batch
from asyncrl.single_controller.distbatch import DistBatch, Piece
from transport.codec import decode, encode


def make(n: int = 4) -> Batch:
    """ids[i] = [2i, 2i+1], score[i] = i/2, prompt[i] = "p{i}"."""
    return Batch({"ids": torch.arange(2 * n).view(n, 2), "score": torch.arange(n) / 2},
                 {"prompt": [f"p{i}" for i in range(n)]}, {"step": 7})


def prompts(b: Batch) -> list[str]:
    return b["prompt"]


# construction ---------------------------------------------------------------------------
def test_construction_and_basics():
    b = make()
    assert len(b) == 4
    assert b.keys() == ["ids", "score", "prompt"]
    assert "ids" in b and "prompt" in b and "nope" not in b
    assert torch.equal(b["ids"], torch.tensor([[0, 1], [2, 3], [4, 5], [6, 7]]))
    assert b["prompt"] == ["p0", "p1", "p2", "p3"]
    assert b.meta == {"step": 7}
    assert len(Batch()) == 0 and Batch().keys() == []
    assert len(Batch(meta={"a": 1})) == 0
    assert len(Batch(non_tensors={"s": ["x", "y"]})) == 2


def test_non_tensor_inputs_become_lists():
    arr = np.empty(3, dtype=object)
    arr[:] = [{"a": 1}, "s", None]
    b = Batch(non_tensors={"t": ("x", "y", "z"), "o": arr})
    assert b["t"] == ["x", "y", "z"] and isinstance(b["t"], list)
    assert b["o"] == [{"a": 1}, "s", None] and isinstance(b["o"], list)


def test_row_mismatch_names_column_and_sizes():
    with pytest.raises(ValueError, match=r"'a' has 3 rows.*'b' has 2"):
        Batch({"a": torch.zeros(3), "b": torch.zeros(2)})
    with pytest.raises(ValueError, match=r"'a' has 3 rows.*'s' has 4"):
        Batch({"a": torch.zeros(3)}, {"s": list("abcd")})


def test_bad_columns_rejected():
    with pytest.raises(ValueError, match="0-d"):
        Batch({"a": torch.tensor(1.0)})
    with pytest.raises(TypeError, match="'s' must be a list"):
        Batch(non_tensors={"s": "abc"})
    with pytest.raises(TypeError, match="torch.Tensor"):
        Batch({"a": [1, 2]})  # type: ignore[dict-item]
    with pytest.raises(ValueError, match="both"):
        Batch({"a": torch.zeros(2)}, {"a": [1, 2]})


def test_repr_is_compact():
    r = repr(make())
    assert r == ("Batch(4 rows; ids: int64[4, 2], score: float32[4], prompt: list[4]; "
                 "meta ['step'])")
    assert repr(Batch()) == "Batch(0 rows; no columns; meta [])"


# indexing ------------------------------------------------------------------------------
def test_getitem_missing_column_lists_available():
    with pytest.raises(KeyError, match=r"'nope'.*\['ids', 'score', 'prompt'\]"):
        make()["nope"]


def test_getitem_int_gives_one_row_batch():
    b = make()
    row = b[2]
    assert isinstance(row, Batch) and len(row) == 1
    assert torch.equal(row["ids"], torch.tensor([[4, 5]]))
    assert row["prompt"] == ["p2"] and row.meta == {"step": 7}
    assert b[-1]["prompt"] == ["p3"]
    with pytest.raises(IndexError, match="row 4 is out of range for a batch of 4 rows"):
        b[4]
    with pytest.raises(IndexError):
        b[-5]


def test_getitem_slice_is_a_view():
    b = make()
    s = b[1:3]
    assert prompts(s) == ["p1", "p2"] and s.meta == {"step": 7}
    assert torch.equal(s["ids"], torch.tensor([[2, 3], [4, 5]]))
    assert s["ids"].data_ptr() == b["ids"][1].data_ptr()  # no copy
    s["ids"][0, 0] = 100
    assert b["ids"][1, 0] == 100
    assert prompts(b[::2]) == ["p0", "p2"]
    assert prompts(b[::-1]) == ["p3", "p2", "p1", "p0"]
    assert torch.equal(b[::-1]["score"], torch.tensor([1.5, 1.0, 0.5, 0.0]))
    assert len(b[10:]) == 0


def test_getitem_indices_and_masks():
    b = make()
    for key in ([3, 0, 0], torch.tensor([3, 0, 0]), np.array([3, 0, 0]), [-1, 0, -4]):
        got = b[key]
        assert prompts(got) == ["p3", "p0", "p0"], key
        assert torch.equal(got["ids"], torch.tensor([[6, 7], [0, 1], [0, 1]]))
    for mask in (torch.tensor([True, False, True, False]), [True, False, True, False]):
        got = b[mask]
        assert prompts(got) == ["p0", "p2"]
        assert torch.equal(got["score"], torch.tensor([0.0, 1.0]))
    with pytest.raises(IndexError, match="mask of 3 entries"):
        b[torch.tensor([True, False, True])]
    with pytest.raises(IndexError, match="row 9"):
        b[[0, 9]]
    with pytest.raises(TypeError, match="integers"):
        b[torch.tensor([0.0, 1.0])]


def test_setitem_adds_and_replaces():
    b = make()
    b["reward"] = torch.tensor([1.0, 0.0, 1.0, 0.0])
    b["tag"] = ("a", "b", "c", "d")
    assert b.keys() == ["ids", "score", "reward", "prompt", "tag"]
    assert b["tag"] == ["a", "b", "c", "d"]
    b["score"] = ["s0", "s1", "s2", "s3"]  # a column may change kind
    assert "score" in b.non_tensors and "score" not in b.tensors
    with pytest.raises(ValueError, match="'x' has 3 rows but the batch has 4"):
        b["x"] = torch.zeros(3)
    e = Batch(meta={"k": 1})
    e["x"] = torch.zeros(5)
    assert len(e) == 5
    one = Batch({"x": torch.zeros(2)})
    one["x"] = torch.zeros(3)  # replacing the only column may change the row count
    assert len(one) == 3


# columns -------------------------------------------------------------------------------
def test_select():
    b = make()
    s = b.select("prompt", "ids")
    assert s.keys() == ["ids", "prompt"] and s.meta == {"step": 7}
    assert s["ids"] is b["ids"]
    s.meta["step"] = 8
    assert b.meta["step"] == 7  # meta is copied
    assert b.select("ids", meta=False).meta == {}
    with pytest.raises(KeyError, match=r"'x'.*available columns: \['ids', 'score', 'prompt'\]"):
        b.select("ids", "x")


def test_pop():
    b = make()
    popped = b.pop("score", "prompt")
    assert popped.keys() == ["score", "prompt"] and popped.meta == {"step": 7}
    assert b.keys() == ["ids"]
    with pytest.raises(KeyError):
        b.pop("ids", "score")
    assert b.keys() == ["ids"]  # nothing removed when a name is missing


def test_union():
    b = make()
    left = b.select("ids", "prompt")
    right = Batch({"ids": b["ids"].clone(), "r": torch.ones(4)}, {"q": list("abcd")}, {"lr": 0.1})
    u = left.union(right)
    assert u.keys() == ["ids", "r", "prompt", "q"]
    assert u.meta == {"step": 7, "lr": 0.1}
    assert left.keys() == ["ids", "prompt"]  # a new batch
    assert len(Batch(meta={"a": 1}).union(b)) == 4


def test_union_conflicts():
    b = make()
    with pytest.raises(ValueError, match="4 rows with one of 2 rows"):
        b.union(Batch({"x": torch.zeros(2)}))
    other = b["ids"].clone()
    other[0, 0] = -1
    with pytest.raises(ValueError, match="column 'ids'"):
        b.union(Batch({"ids": other}))
    with pytest.raises(ValueError, match="column 'prompt'"):
        b.union(Batch(non_tensors={"prompt": ["p0", "p1", "p2", "x"]}))
    with pytest.raises(ValueError, match="column 'ids'"):
        b.union(Batch({"ids": b["ids"].float()}))  # same values, different dtype
    with pytest.raises(ValueError, match=r"meta\['step'\] differs"):
        b.union(Batch(meta={"step": 8}))
    assert b.union(Batch(meta={"step": 7})).meta == {"step": 7}


# rows ----------------------------------------------------------------------------------
def test_chunk():
    b = make(6)
    parts = b.chunk(3)
    assert [prompts(p) for p in parts] == [["p0", "p1"], ["p2", "p3"], ["p4", "p5"]]
    assert torch.equal(parts[2]["ids"], torch.tensor([[8, 9], [10, 11]]))
    assert parts[1]["ids"].data_ptr() == b["ids"][2].data_ptr()
    assert all(p.meta == {"step": 7} for p in parts)
    with pytest.raises(ValueError, match=r"cannot chunk 6 rows into 4.*pad_to_divisor\(4\)"):
        b.chunk(4)
    with pytest.raises(ValueError):
        b.chunk(0)


def test_split():
    b = make(5)
    assert [prompts(p) for p in b.split(2)] == [["p0", "p1"], ["p2", "p3"], ["p4"]]
    assert [len(p) for p in b.split(5)] == [5]
    assert [len(p) for p in b.split(10)] == [5]
    assert Batch().split(3) == []
    with pytest.raises(ValueError):
        b.split(0)


def test_slice_and_take():
    b = make()
    s = b.slice(1, 3)
    assert prompts(s) == ["p1", "p2"]
    assert s["score"].data_ptr() == b["score"][1:].data_ptr()
    t = b.take([2, 2, 0])
    assert prompts(t) == ["p2", "p2", "p0"]
    assert torch.equal(t["score"], torch.tensor([1.0, 1.0, 0.0]))
    assert torch.equal(b.take(torch.tensor([1]))["ids"], torch.tensor([[2, 3]]))
    assert len(b.take([])) == 0 and b.take([]).keys() == b.keys()
    with pytest.raises(TypeError, match="bool mask"):
        b.take(torch.tensor([True, False, True, False]))


def test_concat():
    b = make(5)
    c = Batch.concat([b[:2], b[2:3], b[3:]])
    assert c.equal(b)
    with_meta = Batch.concat([Batch({"x": torch.zeros(1)}, meta={"a": 1}),
                              Batch({"x": torch.ones(2)}, meta={"a": 2})])
    assert with_meta.meta == {"a": 1} and torch.equal(with_meta["x"], torch.tensor([0.0, 1, 1]))


def test_concat_errors():
    b = make()
    with pytest.raises(ValueError, match=r"batch 1 .*tensor columns \(missing \['score'\], extra \[\]\)"):
        Batch.concat([b, b.select("ids", "prompt")])
    with pytest.raises(ValueError, match=r"non-tensor columns \(missing \[\], extra \['x'\]\)"):
        Batch.concat([b.select("ids"), b.select("ids").union(Batch(non_tensors={"x": list("abcd")}))])
    with pytest.raises(ValueError, match="column 'ids'.*float32"):
        Batch.concat([b.select("ids"), Batch({"ids": b["ids"].float()})])
    with pytest.raises(ValueError, match=r"column 'ids'.*shape \[3\]"):
        Batch.concat([b.select("ids"), Batch({"ids": torch.zeros(2, 3, dtype=torch.int64)})])
    with pytest.raises(ValueError, match="empty"):
        Batch.concat([])


def test_repeat_interleave_vs_tile():
    b = make(2)
    inter = b.repeat(3)
    assert prompts(inter) == ["p0", "p0", "p0", "p1", "p1", "p1"]
    assert torch.equal(inter["ids"], torch.tensor([[0, 1]] * 3 + [[2, 3]] * 3))
    tile = b.repeat(2, interleave=False)
    assert prompts(tile) == ["p0", "p1", "p0", "p1"]
    assert torch.equal(tile["ids"], torch.tensor([[0, 1], [2, 3], [0, 1], [2, 3]]))
    assert torch.equal(tile["score"], torch.tensor([0.0, 0.5, 0.0, 0.5]))
    assert tile.meta == {"step": 7}
    assert b.repeat(1).equal(b) and len(b.repeat(0)) == 0


def test_pad_to_divisor_values():
    b = make(3)
    p = b.pad_to_divisor(4)
    assert p.pad_size == 1 and p.meta == {"step": 7, "pad_size": 1}
    assert prompts(p) == ["p0", "p1", "p2", "p0"]
    assert torch.equal(p["ids"], torch.tensor([[0, 1], [2, 3], [4, 5], [0, 1]]))
    cyc = make(2).pad_to_divisor(7)  # fewer rows than needed: cycle through them
    assert cyc.pad_size == 5 and prompts(cyc) == ["p0", "p1", "p0", "p1", "p0", "p1", "p0"]
    assert b.pad_to_divisor(3).pad_size == 0 and "pad_size" not in b.meta
    assert b.pad_size == 0
    with pytest.raises(ValueError):
        b.pad_to_divisor(0)


@pytest.mark.parametrize("n", range(10))
@pytest.mark.parametrize("divisor", [1, 2, 3, 4])
def test_pad_unpad_roundtrip(n, divisor):
    b = make(n)
    p = b.pad_to_divisor(divisor)
    assert len(p) % divisor == 0
    assert p.pad_size == len(p) - n and 0 <= p.pad_size < max(divisor, 1)
    assert prompts(p)[:n] == prompts(b)
    chunks = p.chunk(divisor)
    assert len(chunks) == divisor
    u = p.unpad()
    assert u.pad_size == 0 and u.meta == {"step": 7, "pad_size": 0}
    assert len(u) == n and prompts(u) == prompts(b)
    assert torch.equal(u["ids"], b["ids"]) and torch.equal(u["score"], b["score"])


def test_repadding_accumulates_and_unpad_checks():
    p = make(3).pad_to_divisor(2).pad_to_divisor(3)  # 3 -> 4 -> 6
    assert len(p) == 6 and p.pad_size == 3
    assert prompts(p.unpad()) == ["p0", "p1", "p2"]
    bad = Batch({"x": torch.zeros(2)}, meta={"pad_size": 3})
    with pytest.raises(ValueError, match="pad_size"):
        bad.unpad()


# tensors -------------------------------------------------------------------------------
def test_to_contiguous_nbytes():
    b = Batch({"t": torch.arange(12).view(3, 4).t(), "f": torch.zeros(4, 2, dtype=torch.bfloat16)},
              {"s": list("abcd")}, {"k": 1})
    assert not b["t"].is_contiguous()
    c = b.contiguous()
    assert c["t"].is_contiguous() and c.equal(b)
    assert c["f"] is b["f"]  # already contiguous: no copy
    assert b.nbytes() == 12 * 8 + 8 * 2
    moved = b.to("cpu")
    assert moved.equal(b) and moved["s"] == b["s"] and moved.meta == b.meta
    assert b.to(torch.device("meta"))["f"].device.type == "meta"


def test_equal():
    b = make()
    assert b.equal(make())
    assert not b.equal("not a batch")
    assert not b.equal(b.select("ids", "score"))
    assert not b.equal(Batch(b.tensors, b.non_tensors, {"step": 8}))
    assert not b.equal(Batch({**b.tensors, "score": b["score"].double()}, b.non_tensors, b.meta))
    nan = Batch({"x": torch.tensor([float("nan"), 1.0])})
    assert nan.equal(Batch({"x": torch.tensor([float("nan"), 1.0])}))


def test_from_rows():
    b = Batch.from_rows([
        {"ids": torch.tensor([1, 2]), "reward": 1.0, "n": 3, "ok": True, "text": "a", "info": {"k": 1}},
        {"ids": torch.tensor([3, 4]), "reward": 0.5, "n": 4, "ok": False, "text": "b", "info": None},
    ])
    assert b.keys() == ["ids", "reward", "n", "ok", "text", "info"]
    assert torch.equal(b["ids"], torch.tensor([[1, 2], [3, 4]]))
    assert b["reward"].dtype == torch.float32 and b["reward"].tolist() == [1.0, 0.5]
    assert b["n"].dtype == torch.int64 and b["n"].tolist() == [3, 4]
    assert b["ok"].dtype == torch.bool and b["ok"].tolist() == [True, False]
    assert b["text"] == ["a", "b"] and b["info"] == [{"k": 1}, None]
    assert len(Batch.from_rows([])) == 0
    mixed = Batch.from_rows([{"v": 1}, {"v": "x"}])
    assert mixed["v"] == [1, "x"]
    with pytest.raises(ValueError, match=r"row 1 .*missing \['b'\]"):
        Batch.from_rows([{"a": 1, "b": 2}, {"a": 1}])
    with pytest.raises(ValueError, match="cannot stack column 'ids'"):
        Batch.from_rows([{"ids": torch.zeros(2)}, {"ids": torch.zeros(3)}])


# wire format ---------------------------------------------------------------------------
def test_codec_roundtrip():
    assert EXT_BATCH == 17
    b = Batch(
        {"mask": torch.tensor([True, False, True]),
         "logp": torch.linspace(-1, 1, 3 * 300).view(3, 300).to(torch.bfloat16),
         "ids": torch.arange(3 * 100).view(3, 100)},
        {"prompt": ["héllo", "", "x" * 1000], "info": [{"a": [1, 2]}, None, {"b": 1.5}]},
        {"step": 3, "pad_size": 0, "name": "rollout", "temps": [0.7, 1.0]})
    frames = encode({"batch": b, "other": 1})
    assert len(frames) == 3  # the two large tensors travel as out-of-band frames
    got = decode(frames)["batch"]
    assert isinstance(got, Batch) and got.equal(b)
    assert got["mask"].dtype == torch.bool and got["logp"].dtype == torch.bfloat16
    assert got["prompt"] == ["héllo", "", "x" * 1000]
    assert got.meta == {"step": 3, "pad_size": 0, "name": "rollout", "temps": [0.7, 1.0]}


def test_codec_roundtrip_of_views_and_empty():
    b = make(6)[1:5:2]  # non-contiguous view
    assert decode(encode(b)).equal(b)
    assert decode(encode(Batch())).equal(Batch())
    assert decode(encode(Batch(meta={"k": 1}))).meta == {"k": 1}


def test_a_dist_batch_sends_each_ref_once_with_only_the_inline_rows_it_reads():
    """On the wire a DistBatch names each ref once; a ref carrying its value inline (a small
    driver batch) carries only the rows the batch's pieces read (one rank's share)."""
    from objectstore import ObjectRef
    from transport import codec

    rows = {"x": torch.arange(20.0).reshape(10, 2)}
    ref = ObjectRef("o1", "n", "tcp://h:1", "h:2", "batch", nbytes=80, columns=(("x", "float32", (10, 2)),),
                    num_rows=10, inline=rows)
    d = DistBatch([(Piece(ref, 4, 6, ("x",)),), (Piece(ref, 6, 8, ("x",)),)])
    back = codec.decode(codec.encode(d))
    sent = {p.ref.object_id: p.ref for b in back.blocks for p in b}
    assert list(sent) == ["o1"] and sent["o1"].inline_start == 4
    assert torch.equal(sent["o1"].inline["x"], rows["x"][4:8])
    assert [(p.start, p.stop) for b in back.blocks for p in b] == [(4, 6), (6, 8)]


def test_a_calls_phase_time_is_its_slowest_ranks():
    """Gathered rank outputs keep the first rank's meta, except `timing/` entries: the slowest
    rank's (the step waits for it); per-rank metric dicts likewise."""
    from asyncrl.metrics import mean_metrics
    from asyncrl.single_controller.protocols import CallContext, gather

    parts = [Batch({"x": torch.zeros(2)}, meta={"timing/gen_s": 0.010, "step": 3}),
             Batch({"x": torch.ones(2)}, meta={"timing/gen_s": 0.014, "step": 3})]
    out = gather(CallContext("g", "m", 2, {}), parts)
    assert out.meta == {"timing/gen_s": 0.014, "step": 3} and len(out) == 4
    assert mean_metrics([{"timing/update_actor_s": 0.5, "loss": 1.0},
                         {"timing/update_actor_s": 0.7, "loss": 3.0}]) == {"timing/update_actor_s": 0.7, "loss": 2.0}
