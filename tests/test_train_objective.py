"""The training objective's numbers, checked against values worked out by hand: the fused
soft-target loss and its gradient, D-PACE's position weights, the LM head only at weighted
slots, and the drafter's final norm initialised from the target's."""

import math

import torch

from dflash.train import objective
from dflash.train.objective import dpace_weights, slot_weights, token_losses


def test_soft_target_loss_and_gradient_by_hand():
    # Head = identity, so the logits are the hidden state: softmax q = [0.1, 0.2, 0.3, 0.4].
    hidden = torch.log(torch.tensor([[1.0, 2.0, 3.0, 4.0]], dtype=torch.float64)).requires_grad_()
    head = torch.eye(4, dtype=torch.float64)
    label = torch.tensor([3])
    # Teacher top-2: tokens 3 and 2 with logits ln 3, ln 1 -> p_T = [0.75, 0.25].
    soft = (torch.tensor([[3, 2]], dtype=torch.int32), torch.log(torch.tensor([[3.0, 1.0]])))
    ce = -math.log(0.4)  # 0.916291
    kl = 0.75 * math.log(0.75 / 0.4) + 0.25 * math.log(0.25 / 0.3)  # 0.425876
    assert abs(ce - 0.916291) < 1e-6 and abs(kl - 0.425876) < 1e-6

    out = token_losses(hidden, head, label)
    assert abs(out["loss"].item() - 0.916291) < 1e-5 and abs(out["ce"].item() - 0.916291) < 1e-5

    out = token_losses(hidden, head, label, soft, soft_mix=0.5, accuracy=True)
    assert abs(out["loss"].item() - (0.5 * 0.916291 + 0.5 * 0.425876)) < 1e-5  # 0.671083
    assert abs(out["ce"].item() - 0.916291) < 1e-5 and out["correct"].tolist() == [True]
    out["loss"].sum().backward()
    # d loss / d logits = q - (0.5 * onehot(3) + 0.5 * p_T) = [0.1, 0.2, 0.3 - 0.125, 0.4 - 0.875]
    assert torch.allclose(hidden.grad, torch.tensor([[0.1, 0.2, 0.175, -0.475]], dtype=torch.float64), atol=1e-6)


def test_fused_head_loss_matches_autograd_reference_in_chunks():
    torch.manual_seed(0)
    h = torch.randn(9, 16, dtype=torch.float64, requires_grad=True)
    W = torch.randn(50, 16, dtype=torch.float64)
    y = torch.randint(0, 50, (9,))
    soft = (torch.randint(0, 50, (9, 5)), torch.randn(9, 5))
    w = torch.rand(9, dtype=torch.float64)
    for mix, chunk in ((0.0, None), (0.3, 4)):
        out = token_losses(h, W, y, soft, mix, chunk_rows=chunk)
        (out["loss"] * w).sum().backward()
        fused, h.grad = h.grad, None
        logits = h @ W.t()
        ref = (1 - mix) * torch.nn.functional.cross_entropy(logits, y, reduction="none")
        ref = ref + mix * objective.soft_kl(logits, *soft).double()
        (ref * w).sum().backward()
        assert torch.allclose(out["loss"].double(), ref, atol=1e-5)
        assert torch.allclose(fused, h.grad, atol=1e-5)
        h.grad = None


def test_dpace_weights_by_hand():
    # confidences q = [0.8, 0.5, 0.2]; smoothed with alpha 0.5: [0.9, 0.75, 0.6];
    # prefix products [0.9, 0.675, 0.405]; suffix sums [1.98, 1.08, 0.405]; slot 4 has no label.
    ce = -torch.log(torch.tensor([[0.8, 0.5, 0.2, 0.9]]))
    valid = torch.tensor([[True, True, True, False]])
    w = dpace_weights(ce, valid, alpha=0.5)
    assert torch.allclose(w, torch.tensor([[1.98, 1.08, 0.405, 0.0]]), atol=1e-6)
    assert not w.requires_grad


def test_slot_weights():
    w = slot_weights(16, "decay", 7.0, None)
    assert w[0] == 0 and torch.allclose(w[1:4], torch.exp(-torch.tensor([0.0, 1.0, 2.0]) / 7.0))
    assert slot_weights(8, "uniform", None, 3).tolist() == [0, 1, 1, 1, 0, 0, 0, 0]


def test_head_runs_only_at_weighted_slots(monkeypatch):
    from dflash.engine.drafter import init_random_drafter
    from dflash.train.objective import build_blocks, sample_anchors
    from dflash.train.trainer import TrainConfig, batch_loss, make_batch
    from tests.conftest import tiny_drafter_config

    rows = []
    real = objective.HeadLoss.apply
    monkeypatch.setattr(objective.HeadLoss, "apply", lambda h, *a: rows.append(len(h)) or real(h, *a))

    class Store:
        topk = 0

        def features(self, seq, dtype):
            return torch.randn(len(seq["ids"]), 2 * 32).to(dtype)

    dcfg = tiny_drafter_config(vocab=64, block_size=8)
    drafter = init_random_drafter(dcfg)
    ids = torch.randint(5, 60, (30,))
    anchors = sample_anchors(30, 10, 512)  # 19 anchors: 10..28
    for positions, expected in ((None, sum(min(7, 29 - a) for a in range(10, 29))),
                                (2, sum(min(2, 29 - a) for a in range(10, 29)))):
        b = build_blocks(ids, anchors, 8, 3, slot_weights(8, "decay", None, positions))
        batch = make_batch(Store(), [{"ids": ids.tolist()}], [b], torch.device("cpu"))
        rows.clear()
        loss, _ = batch_loss(drafter, torch.randn(64, 32), torch.randn(64, 32), batch,
                             TrainConfig(autocast=False), torch.device("cpu"))
        assert rows == [expected] and torch.isfinite(loss)


def test_new_drafter_takes_the_targets_final_norm():
    from dflash.train.pipeline import drafter_config_for, new_drafter
    from tests.conftest import make_tiny_target

    target = make_tiny_target(vocab=64)
    with torch.no_grad():
        target.model.get_decoder().norm.weight.copy_(1.8 + 0.1 * torch.randn(32))
    dcfg = drafter_config_for(target, layers=1, block_size=8, layer_ids=[0, 2], mask_token_id=3)
    for init in ("random", "target"):
        drafter = new_drafter(target, dcfg, init, seed=0)
        assert torch.equal(drafter.norm.weight, target.model.get_decoder().norm.weight)
        assert abs(drafter.norm.weight.mean().item() - 1.8) < 0.1


def test_soft_targets_are_gathered_only_for_a_run_that_uses_them():
    from dflash.train.objective import build_blocks, sample_anchors
    from dflash.train.trainer import make_batch

    class Store:
        topk = 4

        def features(self, seq, dtype):
            return torch.zeros(len(seq["ids"]), 8).to(dtype)

        def soft_targets(self, seq):
            n = len(seq["ids"])
            return torch.arange(n * 4, dtype=torch.int32).view(n, 4), torch.ones(n, 4, dtype=torch.float16)

    ids = torch.randint(5, 60, (20,))
    b = build_blocks(ids, sample_anchors(20, 10, 512), 4, 3, slot_weights(4, "dpace", None, None))
    used = make_batch(Store(), [{"ids": ids.tolist()}], [b], torch.device("cpu"))
    skipped = make_batch(Store(), [{"ids": ids.tolist()}], [b], torch.device("cpu"), soft=False)
    assert used.soft_ids.shape == (1, len(b.anchors), 4, 4)
    # slot j of the block at anchor p holds token p+j: its soft targets are row p+j-1's
    p = int(b.anchors[0])
    assert used.soft_ids[0, 0, 1].tolist() == list(range(4 * p, 4 * p + 4))
    assert skipped.soft_ids is None and skipped.soft_logits is None
    assert torch.equal(used.feats, skipped.feats)


def test_the_cosine_follows_the_larger_share_of_a_time_or_cpu_budget():
    from dflash.train.trainer import TrainConfig, budget_share, budget_spent, schedule_step

    assert budget_share(TrainConfig(cpu_budget_s=100), 10, 50) is None  # schedule by epochs
    cfg = TrainConfig(schedule_by_budget=True, cpu_budget_s=100)
    assert budget_share(cfg, 10, 50) == 0.5
    both = TrainConfig(schedule_by_budget=True, time_budget_s=20, cpu_budget_s=100)
    assert budget_share(both, 15, 50) == 0.75 and budget_share(both, 5, 60) == 0.6
    assert schedule_step(3, 1000, 0.5) == 500  # half the budget spent: half-way down the cosine
    assert not budget_spent(both, 19, 99) and budget_spent(both, 20, 0) and budget_spent(both, 0, 100)
    assert not budget_spent(TrainConfig(), 1e9, 1e9)  # no budget: epochs decide
    assert schedule_step(700, 1000, 0.5) == 700  # never behind the steps taken
    assert schedule_step(3, 1000, None) == 3
