"""ExpertLoadRecorder: windowing, physical-count folding, top-k counting."""

import pytest
import torch

from moe_comm.eplb.load import ExpertLoadRecorder


def test_window_slides():
    rec = ExpertLoadRecorder(2, 3, window=3)
    for step in range(5):  # step k adds k+1 tokens to expert 0 of layer 0
        rec.record(0, torch.tensor([step + 1, 0, 0]))
        # open step (step+1) plus up to 3 completed steps before it
        assert rec.load()[0, 0] == sum(j + 1 for j in range(max(0, step - 3), step + 1))
        rec.step()
    # completed steps 3, 4, 5 (values) remain in the window of 3
    assert rec.load().tolist() == [[3 + 4 + 5, 0, 0], [0, 0, 0]]
    assert rec.load(include_open=False).tolist() == [[12, 0, 0], [0, 0, 0]]
    assert rec.steps == 5
    rec.record(1, torch.tensor([0, 7, 0]))
    assert rec.load()[1].tolist() == [0, 7, 0] and rec.load(include_open=False)[1].tolist() == [0, 0, 0]
    rec.reset()
    assert rec.load().sum() == 0 and rec.steps == 0


def test_record_topk_and_physical():
    rec = ExpertLoadRecorder(2, 4, window=2)
    rec.record_topk(1, torch.tensor([[0, 3], [3, -1], [2, 3]]))
    phy2log = torch.tensor([[0, 1, 2, 3, 0, -1], [3, 3, 1, 0, 2, -1]])
    rec.record(0, torch.tensor([1, 2, 3, 4, 5, 9]), phy2log)  # slot 5 holds nothing: ignored
    rec.record(1, torch.tensor([1, 1, 0, 0, 0, 0]), phy2log)  # uses row 1 of phy2log
    assert rec.load().tolist() == [[6, 2, 3, 4], [1, 0, 1, 5]]
    rec.step()
    rec.step()
    rec.step()
    assert rec.load().sum() == 0


def test_float_and_validation():
    rec = ExpertLoadRecorder(1, 2, window=2, dtype=torch.float64)
    for _ in range(10):
        rec.record(0, torch.tensor([0.1, 0.2]))
        rec.step()
    assert torch.allclose(rec.load(), torch.tensor([[0.2, 0.4]], dtype=torch.float64))
    irec = ExpertLoadRecorder(1, 2)
    with pytest.raises(TypeError, match="float"):
        irec.record(0, torch.tensor([0.5, 1.0]))
    with pytest.raises(ValueError, match="layer"):
        irec.record(1, torch.tensor([1, 1]))
    with pytest.raises(ValueError, match="counts"):
        irec.record(0, torch.tensor([1, 1, 1]))
    with pytest.raises(ValueError, match="topk_idx"):
        irec.record_topk(0, torch.tensor([[2]]))
    with pytest.raises(ValueError, match="window"):
        ExpertLoadRecorder(1, 2, window=0)
