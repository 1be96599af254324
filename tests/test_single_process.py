import pytest
import torch

from swarm.training.data import load_corpus, validation_batches
from swarm.training.single_process import evaluate, train_single_process
from swarm.model.gpt import ModelConfig
from swarm.model.stages import FullModel
from swarm.training.optimizer import OptimizerConfig

TINY = ModelConfig(vocab_size=256, seq_len=32, num_layers=2, hidden_size=32, num_heads=2)


@pytest.fixture(scope="module")
def corpus():
    return load_corpus(max_bytes=300_000)


def test_loss_decreases(corpus):
    config = OptimizerConfig(lr=3e-3, max_grad_norm=1.0)
    batches = validation_batches(corpus.validation, TINY.seq_len, batch_size=16, num_batches=4)
    initial = evaluate(FullModel(TINY, 2, seed=0), batches)
    model, losses = train_single_process(
        TINY, num_stages=2, seed=0, optimizer_config=config, batch_size=16, num_steps=40, sampler_seed=0, corpus=corpus
    )
    assert len(losses) == 40
    first, last = sum(losses[:5]) / 5, sum(losses[-5:]) / 5
    assert last < first - 1.0, (first, last)  # from ~ln(256) = 5.5 towards byte unigram statistics
    assert evaluate(model, batches) < initial - 1.0


def test_training_is_deterministic(corpus):
    args = dict(optimizer_config=OptimizerConfig(), batch_size=4, num_steps=3, sampler_seed=5, corpus=corpus)
    model_a, losses_a = train_single_process(TINY, 2, 1, **args)
    model_b, losses_b = train_single_process(TINY, 2, 1, **args)
    assert losses_a == losses_b
    assert all(torch.equal(p, q) for p, q in zip(model_a.parameters(), model_b.parameters()))
