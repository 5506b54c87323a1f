import pytest
import torch

from diloco.config import InnerSection
from diloco.model.gpt import GPT, GPTConfig
from diloco.train import InnerTrainer, evaluate, load_parameters, lr_at, make_adamw, snapshot


def test_lr_warms_up_linearly_then_decays_by_cosine_to_the_floor():
    inner = InnerSection(lr=1.0, warmup_steps=4, schedule="cosine", min_lr_ratio=0.1)

    lrs = [lr_at(s, inner=inner, total_steps=104) for s in (0, 3, 4, 54, 104, 500)]

    assert lrs[:2] == [0.25, 1.0]
    assert lrs[2] == pytest.approx(1.0)
    assert lrs[3] == pytest.approx(0.1 + 0.45)  # half way: floor + half the span
    assert lrs[4] == pytest.approx(0.1) and lrs[5] == pytest.approx(0.1)


def test_constant_schedule_keeps_the_lr_after_warmup():
    inner = InnerSection(lr=0.5, warmup_steps=0, schedule="constant")

    assert {lr_at(s, inner=inner, total_steps=10) for s in range(20)} == {0.5}


def test_weight_decay_applies_to_matrices_only():
    model = GPT(GPTConfig(n_layer=1, n_head=2, n_embd=16, block_size=8))

    decay, no_decay = make_adamw(model, InnerSection(weight_decay=0.1)).param_groups

    assert decay["weight_decay"] == 0.1 and all(p.dim() == 2 for p in decay["params"])
    assert no_decay["weight_decay"] == 0.0 and all(p.dim() == 1 for p in no_decay["params"])


def test_adamw_state_survives_loading_new_parameters():
    torch.manual_seed(0)
    cfg = GPTConfig(n_layer=1, n_head=2, n_embd=16, block_size=8)
    trainer = InnerTrainer(
        GPT(cfg),
        InnerSection(steps=2, batch_size=2, warmup_steps=0),
        total_steps=10,
        device=torch.device("cpu"),
    )
    batch = (torch.randint(0, 256, (2, 8)), torch.randint(0, 256, (2, 8)))
    trainer.run(2, start_step=0, next_batch=lambda: batch)
    state_before = {k: v["exp_avg"].clone() for k, v in enumerate(trainer.optimizer.state.values())}

    load_parameters(trainer.model, snapshot(GPT(cfg)))

    state_after = list(trainer.optimizer.state.values())
    assert all(torch.equal(state_before[i], s["exp_avg"]) for i, s in enumerate(state_after))
    assert trainer.optimizer.param_groups[0]["params"][0] is next(trainer.model.parameters())


@pytest.mark.parametrize("reset", [True, False])
def test_a_lease_starts_with_the_first_moment_zeroed_when_the_config_says_so(reset):
    torch.manual_seed(0)
    cfg = GPTConfig(n_layer=1, n_head=2, n_embd=16, block_size=8)
    inner = InnerSection(steps=2, batch_size=2, warmup_steps=0, reset_momentum=reset)
    trainer = InnerTrainer(GPT(cfg), inner, total_steps=10, device=torch.device("cpu"))
    batch = (torch.randint(0, 256, (2, 8)), torch.randint(0, 256, (2, 8)))
    trainer.run(2, start_step=0, next_batch=lambda: batch)
    before = [{k: v.clone() for k, v in s.items()} for s in trainer.optimizer.state.values()]
    theta = snapshot(GPT(cfg))

    trainer.start_lease(theta)

    after = list(trainer.optimizer.state.values())
    assert all(torch.equal(p, theta[n]) for n, p in trainer.model.named_parameters())
    for old, new in zip(before, after, strict=True):
        assert torch.equal(new["exp_avg_sq"], old["exp_avg_sq"]) and new["step"] == old["step"]
        assert old["exp_avg"].abs().sum() > 0
        if reset:
            assert not new["exp_avg"].any()
        else:
            assert torch.equal(new["exp_avg"], old["exp_avg"])


def test_training_lowers_the_loss_on_a_repeated_batch():
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=1, n_head=2, n_embd=32, block_size=16))
    trainer = InnerTrainer(
        model,
        InnerSection(lr=3e-3, warmup_steps=0, schedule="constant"),
        total_steps=30,
        device=torch.device("cpu"),
    )
    batch = (torch.randint(0, 256, (4, 16)), torch.randint(0, 256, (4, 16)))

    result = trainer.run(30, start_step=0, next_batch=lambda: batch)

    assert result.tokens == 30 * 4 * 16
    assert result.losses[-1] < result.losses[0] - 1.0


def test_evaluate_of_an_untrained_model_is_near_uniform_over_bytes():
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=1, n_head=2, n_embd=32, block_size=16))

    loss = evaluate(model, torch.randint(0, 256, (500,), dtype=torch.uint8), block_size=16)

    assert loss == pytest.approx(torch.log(torch.tensor(256.0)).item(), rel=0.02)


def test_loading_parameters_with_other_names_is_refused():
    model = GPT(GPTConfig(n_layer=1, n_head=2, n_embd=16, block_size=8))

    with pytest.raises(KeyError, match="parameter names differ"):
        load_parameters(model, {"w": torch.zeros(1)})
