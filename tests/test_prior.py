"""The prior over the codes: its loss, causality, resume, sampling (KV cache), bits, Fréchet distance,
and the generative loop end to end (tiny tokenizer -> tokenize -> prior -> sample -> evaluate).

Real parts only: a real (tiny) tokenizer trained on Fashion-MNIST, real token files, the real
commands. Sizes are tiny so the file runs in well under a minute on one shared core."""
import dataclasses
import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch

from ddcl_vq import cli
from ddcl_vq.prior.evaluation import frechet_distance
from ddcl_vq.prior.data import PriorData, load_tokens
from ddcl_vq.prior.train import PriorConfig, load_prior, load_prior_config, nll_bits, train_prior
from ddcl_vq.tokenizer.tokens import tokenize_run
from ddcl_vq.models.prior import CodePrior
from ddcl_vq.tokenizer.config import load_config
from ddcl_vq.tokenizer.train import train
from ddcl_vq.common.rundir import RunDirError
from conftest import TINY

ROOT = Path(__file__).resolve().parents[1]
TINY_TOKENIZER = TINY + ["train.eval_images=0"]
TINY_PRIOR = ["model.dim=32", "model.layers=2", "model.heads=2", "train.batch_size=16", "train.steps=3",
              "train.warmup_steps=1", "train.log_every=1", "train.checkpoint_every=2", "train.eval_every=2",
              "train.eval_images=64"]


@pytest.fixture(scope="module")
def tokenized(tmp_path_factory):
    """A tiny DDCL tokenizer trained 6 steps on Fashion-MNIST, its first 256 train / 128 test images tokenized."""
    base = tmp_path_factory.mktemp("prior")
    run = base / "tokenizer"
    train(load_config(ROOT / "configs/fashion_ddcl.yaml", TINY_TOKENIZER + [f"run.dir={run}"]), quiet=True)
    tokenize_run(run, "train", base / "train.npy", max_images=256)
    tokenize_run(run, "test", base / "test.safetensors", max_images=128)
    return {"run": run, "train": base / "train.npy", "test": base / "test.safetensors", "base": base}


def _prior_cfg(tokenized, prior_dir, *extra) -> PriorConfig:
    return load_prior_config(ROOT / "configs/prior_fashion.yaml",
                             [f"data.tokenizer={tokenized['run']}", f"data.train_tokens={tokenized['train']}",
                              f"data.test_tokens=[{tokenized['test']}]", f"run.dir={prior_dir}"] + TINY_PRIOR
                             + list(extra))


def _tiny(num_classes=3, k=11, dropout=0.0) -> CodePrior:
    torch.manual_seed(0)
    return CodePrior(k, 3, 4, num_classes, dim=16, layers=2, heads=2, dropout=dropout)


# --------------------------------------------------------------------------- the model

def test_loss_is_the_mean_negative_log_likelihood_computed_by_hand():
    model = _tiny().double().eval()
    g = torch.Generator().manual_seed(1)
    codes = torch.randint(0, 11, (2, 3, 4), generator=g)
    labels = torch.tensor([2, 0])
    with torch.no_grad():
        logits = model(codes, labels)
    assert logits.shape == (2, 12, 11)
    total, n = 0.0, 0
    for b in range(2):
        for t in range(12):
            row = [float(v) for v in logits[b, t]]
            target = int(codes.reshape(2, -1)[b, t])
            total += -(row[target] - math.log(sum(math.exp(v) for v in row)))
            n += 1
    with torch.no_grad():
        assert float(model.loss(codes, labels)) == pytest.approx(total / n, rel=1e-12)
        # the class token matters: another class, another likelihood
        assert float(model.loss(codes, torch.tensor([1, 1]))) != pytest.approx(total / n, rel=1e-6)


@pytest.mark.parametrize("j", [0, 5, 11])
def test_changing_a_later_code_leaves_earlier_logits_unchanged(j):
    model = _tiny().double().eval()
    codes = torch.randint(0, 11, (3, 12), generator=torch.Generator().manual_seed(2))
    labels = torch.tensor([0, 1, 2])
    changed = codes.clone()
    changed[:, j] = (changed[:, j] + 1) % 11
    a, b = model(codes, labels), model(changed, labels)
    # logits at position p predict code p from codes < p: positions 0..j see nothing of code j
    assert torch.equal(a[:, :j + 1], b[:, :j + 1])
    if j < 11:
        assert not torch.allclose(a[:, j + 1:], b[:, j + 1:])


def test_relabelling_the_codes_relabels_the_prior_and_changes_nothing_else():
    """Why ordering the codes cannot make them cheaper for this prior (docs/prior.md): a code enters
    only through its row of ``code_emb`` and of ``head``, rows drawn alike at init and updated
    entry by entry by AdamW, so relabelling the codes by a permutation relabels the rows of the
    whole training run: the same loss and the same gradients, row for row."""
    model = _tiny().double().eval()
    perm = torch.randperm(11, generator=torch.Generator().manual_seed(3))
    twin = _tiny().double().eval()
    twin.load_state_dict(model.state_dict())
    with torch.no_grad():
        twin.code_emb.weight[perm] = model.code_emb.weight
        twin.head.weight[perm] = model.head.weight
    codes = torch.randint(0, 11, (4, 3, 4), generator=torch.Generator().manual_seed(4))
    labels = torch.tensor([0, 1, 2, 1])
    loss, twin_loss = model.loss(codes, labels), twin.loss(perm[codes], labels)
    assert twin_loss.item() == pytest.approx(loss.item(), rel=1e-12)
    loss.backward()
    twin_loss.backward()
    for name in ("code_emb", "head"):
        grad, twin_grad = getattr(model, name).weight.grad, getattr(twin, name).weight.grad
        assert torch.allclose(twin_grad[perm], grad, rtol=1e-10, atol=1e-14)
    assert torch.allclose(twin.blocks[0].attn.qkv.weight.grad, model.blocks[0].attn.qkv.weight.grad,
                          rtol=1e-10, atol=1e-14)
    # a non-permutation relabelling (two codes merged) is another problem
    merged = codes.clone()
    merged[merged == 1] = 0
    assert model.loss(merged, labels).item() != pytest.approx(loss.item(), rel=1e-6)


def test_sampling_is_reproducible_and_in_range():
    model = _tiny(k=7)
    labels = torch.tensor([0, 1, 2, 0, 1])
    a = model.sample(5, labels, generator=torch.Generator().manual_seed(3))
    b = model.sample(5, labels, generator=torch.Generator().manual_seed(3))
    c = model.sample(5, labels, generator=torch.Generator().manual_seed(4))
    assert a.shape == (5, 3, 4) and a.dtype == torch.long
    assert torch.equal(a, b) and not torch.equal(a, c)
    assert int(a.min()) >= 0 and int(a.max()) < 7
    k1 = model.sample(40, torch.zeros(40, dtype=torch.long), top_k=1, generator=torch.Generator().manual_seed(5))
    greedy = model.sample(40, torch.zeros(40, dtype=torch.long), temperature=0)
    assert torch.equal(k1, greedy)  # top-1 sampling is greedy decoding


@pytest.mark.parametrize("temperature,top_k", [(1.0, 0), (0.7, 3)])
def test_kv_cache_sampling_equals_sampling_without_cache(temperature, top_k):
    model = _tiny(k=13, dropout=0.1).double()  # dropout must be off while sampling
    model.train()
    labels = torch.arange(6) % 3
    cached = model.sample(6, labels, temperature, top_k, generator=torch.Generator().manual_seed(6))
    full = model.sample(6, labels, temperature, top_k, generator=torch.Generator().manual_seed(6), use_cache=False)
    assert torch.equal(cached, full)
    assert model.training  # the model's mode is restored


def test_unconditional_prior_and_bad_input():
    model = _tiny(num_classes=0, k=5)
    codes = model.sample(4)
    assert codes.shape == (4, 3, 4) and int(codes.max()) < 5
    assert model(codes).shape == (4, 12, 5)
    conditional = _tiny(num_classes=3, k=5)
    with pytest.raises(ValueError, match="expected labels"):
        conditional(codes)
    with pytest.raises(ValueError, match=r"expected labels in \[0, 3\)"):
        conditional(codes, torch.tensor([0, 1, 2, 3]))
    with pytest.raises(ValueError, match=r"expected codes in \[0, 5\)"):
        model.loss(torch.full((2, 3, 4), 5))
    with pytest.raises(ValueError, match=r"expected code maps of shape \(B, 3, 4\)"):
        model(torch.zeros(2, 4, 3, dtype=torch.long))


def test_bits_per_token_of_a_uniform_prior_is_log2_k(tokenized):
    tokens = load_tokens(tokenized["test"], 32)
    model = CodePrior(32, 8, 8, 10, dim=16, layers=1, heads=2)
    with torch.no_grad():
        model.head.weight.zero_()  # every logit equal: p(code) = 1/K everywhere
    bits = nll_bits(model, tokens)
    assert bits["bits_per_token"] == pytest.approx(5.0, abs=1e-6)
    assert bits["bits_per_image"] == pytest.approx(5.0 * 64, abs=1e-4)
    assert bits["num_images"] == 128


def test_frechet_distance_is_zero_for_a_set_with_itself_and_grows_under_perturbation():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(400, 8)) @ rng.normal(size=(8, 8))
    assert frechet_distance(x, x) == pytest.approx(0.0, abs=1e-8)
    shift = np.full(8, 0.5)
    assert frechet_distance(x, x + shift) == pytest.approx(float(shift @ shift), rel=1e-8)  # same covariance
    noise = rng.normal(size=x.shape)
    fds = [frechet_distance(x, x + s * noise) for s in (0.1, 0.5, 1.0, 2.0)]
    assert all(a < b for a, b in zip(fds, fds[1:])) and fds[0] > 0
    with pytest.raises(ValueError, match="same F"):
        frechet_distance(x, x[:, :4])


# --------------------------------------------------------------------------- training

def test_config_file_matches_the_built_in_defaults():
    assert load_prior_config(ROOT / "configs/prior_fashion.yaml") == load_prior_config()


def test_three_step_training_resumes_to_identical_weights(tokenized, tmp_path):
    straight = train_prior(_prior_cfg(tokenized, tmp_path / "straight"), PriorData, quiet=True)
    assert straight["step"] == 3 and straight["num_classes"] == 10 and straight["grid"] == [8, 8]
    cfg = _prior_cfg(tokenized, tmp_path / "resumed")
    assert train_prior(cfg, PriorData, quiet=True, stop_after=2)["step"] == 2
    assert train_prior(cfg, PriorData, quiet=True)["step"] == 3
    _, a, _ = load_prior(tmp_path / "straight")
    _, b, meta = load_prior(tmp_path / "resumed")
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)
    assert meta["step"] == 3
    # and the third step did move the weights (a resume that trained nothing would also be "identical")
    at2 = torch.load(tmp_path / "straight" / "checkpoints" / "step_0000002.pt", weights_only=True)["model"]
    assert not torch.equal(at2["head.weight"], sa["head.weight"])
    lines = [json.loads(x) for x in (tmp_path / "resumed" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in lines] == [1, 2, 3] and "test_bits_per_token" in lines[1]
    # another model on the same directory is refused, naming the key
    with pytest.raises(RunDirError, match="model.dim"):
        train_prior(_prior_cfg(tokenized, tmp_path / "resumed", "model.dim=64", "train.steps=4"), PriorData, quiet=True)


def test_one_line_errors(tokenized, tmp_path, capsys):
    assert cli.main(["prior", "train", str(tokenized["run"]), "--tokens", str(tokenized["train"]),
                     "model.dimm=3"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "ddcl-vq prior train: error:" in err and "model.dim" in err
    assert cli.main(["prior", "sample", str(tmp_path / "nothing"), "--count", "4", "--out", "x.png"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "does not exist" in err
    # a seed torch cannot take (issue 51, item 3: a traceback before)
    assert cli.main(["prior", "train", str(tokenized["run"]), "--tokens", str(tokenized["train"]),
                     f"run.seed={2 ** 64}", f"run.dir={tmp_path / 'seed'}"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "config key 'run.seed': expected a seed torch accepts" in err
    assert not (tmp_path / "seed").exists()
    # codes out of the tokenizer's range
    bad = tmp_path / "bad.npy"
    np.save(bad, np.full((4, 8, 8), 40, dtype=np.uint8))
    assert cli.main(["prior", "train", str(tokenized["run"]), "--tokens", str(bad), f"run.dir={tmp_path / 'q'}"]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert "expected indices in [0, 32)" in err


def test_bad_labels_and_too_few_code_maps_are_refused_in_one_line(tokenized, tmp_path, capsys):
    """Labels that are not class indices are refused, never dropped or truncated without a word; a token
    file with fewer maps than one batch names train.batch_size and leaves no prior directory behind."""
    codes = np.load(tokenized["train"])[:40]
    cases = {"negative": (np.arange(40) % 10 - 5, "expected class labels >= 0"),
             "float": (np.full(40, 1.5), "expected integer class labels, got 1.5"),
             "huge": (np.full(40, 10 ** 9), "expected class labels below 100,000")}
    for name, (labels, words) in cases.items():
        path = tmp_path / f"{name}.npy"
        np.save(path, codes)
        np.save(tmp_path / f"{name}.labels.npy", labels)
        prior = tmp_path / f"prior_{name}"
        assert cli.main(["prior", "train", str(tokenized["run"]), "--tokens", str(path), "--quiet",
                         f"run.dir={prior}", "train.batch_size=8", "train.steps=1"]) == 2
        err = capsys.readouterr().err.strip()
        assert err.count("\n") == 0 and words in err, err
        assert not prior.exists()
    np.save(tmp_path / "ok.npy", codes)
    np.save(tmp_path / "ok.labels.npy", np.arange(40) % 10)
    prior = tmp_path / "prior_small"
    assert cli.main(["prior", "train", str(tokenized["run"]), "--tokens", str(tmp_path / "ok.npy"), "--quiet",
                     f"run.dir={prior}", "train.batch_size=64"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "holds 40 code maps, fewer than one batch (train.batch_size=64)" in err, err
    assert "data.batch_size" not in err and " images" not in err and not prior.exists()
    # tokenize's "no labels" (-1 for every map) is an unconditional prior, as before
    np.save(tmp_path / "ok.labels.npy", np.full(40, -1))
    assert cli.main(["prior", "train", str(tokenized["run"]), "--tokens", str(tmp_path / "ok.npy"), "--quiet",
                     f"run.dir={prior}", "train.batch_size=8", "train.steps=1", *TINY_PRIOR[:3]]) == 0
    assert json.loads((prior / "summary.json").read_text())["num_classes"] == 0


# --------------------------------------------------------------------------- the loop, end to end

def test_end_to_end_tokenizer_tokens_prior_samples_evaluation(tokenized, tmp_path, capsys):
    prior = tmp_path / "prior"
    assert cli.main(["prior", "train", str(tokenized["run"]), "--tokens", str(tokenized["train"]), "--test",
                     str(tokenized["test"]), "--config", str(ROOT / "configs/prior_fashion.yaml"), f"run.dir={prior}",
                     "--quiet"] + TINY_PRIOR) == 0
    assert (prior / "config.yaml").is_file() and (prior / "checkpoints" / "last.pt").is_file()
    assert any((prior / "tb").iterdir())

    out = tmp_path / "samples" / "grid.png"
    assert cli.main(["prior", "sample", str(prior), "--count", "12", "--out", str(out), "--seed", "7"]) == 0
    codes = np.load(out.with_suffix(".npy"))
    labels = np.load(out.with_name("grid.labels.npy"))
    assert codes.shape == (12, 8, 8) and codes.dtype == np.uint8 and int(codes.max()) < 32
    assert labels.tolist() == [i % 10 for i in range(12)]
    from PIL import Image
    assert Image.open(out).size[0] > 32 * 8  # 10 images per row (one per class)
    again = tmp_path / "again.png"
    assert cli.main(["prior", "sample", str(prior), "--count", "12", "--out", str(again), "--seed", "7"]) == 0
    assert np.array_equal(np.load(again.with_suffix(".npy")), codes)
    one = tmp_path / "one.png"
    assert cli.main(["prior", "sample", str(prior), "--count", "4", "--class", "3", "--out", str(one)]) == 0
    assert np.load(one.with_name("one.labels.npy")).tolist() == [3, 3, 3, 3]
    capsys.readouterr()

    assert cli.main(["prior", "evaluate", str(prior), "--samples", "20", "--real", "60", "--classifier-steps", "4",
                     "--cache-dir", str(tmp_path / "cache"), "--quiet"]) == 0
    ev = json.loads((prior / "eval.json").read_text())
    assert ev["step"] == 3 and ev["num_codes"] == 32 and ev["num_classes"] == 10
    assert ev["nll"]["num_images"] == 128 and 3.0 < ev["nll"]["bits_per_token"] < 7.0
    assert ev["nll"]["bits_per_image"] == pytest.approx(64 * ev["nll"]["bits_per_token"])
    fd = ev["frechet"]
    assert fd["samples_vs_real"] > 0 and fd["reconstructions_vs_real"] > 0 and fd["num_real"] == 60
    assert "not Inception FID" in fd["note"]
    assert set(ev["class_accuracy"]["per_class"]) == {str(c) for c in range(10)}
    assert (prior / "samples.png").is_file()
    assert ev["classifier"]["cached"] is False and list((tmp_path / "cache").glob("classifier_fashion_mnist_32_*.pt"))
    # the second evaluation reads the cached classifier
    from ddcl_vq.prior.evaluation import evaluate_prior
    ev2 = evaluate_prior(prior, samples=20, real=60, classifier_steps=4, cache_dir=str(tmp_path / "cache"),
                         write=False)
    assert ev2["classifier"]["cached"] is True and ev2["nll"] == ev["nll"]
    assert ev2["frechet"]["samples_vs_real"] == pytest.approx(fd["samples_vs_real"], rel=1e-9)



# --------------------------------------------------------------------------- the study

def test_study_prior_config_declares_every_tokenizer_and_validates(tmp_path):
    from ddcl_vq.studies.prior_study import load_prior_study

    spec, study, prior, tok, ev, seeds, out = load_prior_study(ROOT / "configs/study_prior.yaml", out=tmp_path)
    groups = {a.group for a in study.arms}
    assert groups == {f"{arm}_k{k}" for arm in ("ddcl", "hard", "ema_restart", "vqp_kmeans_expiry", "fsq")
                      for k in (256, 1024)}
    assert {a.config.quantizer["type"] for a in study.arms} == {"ddcl", "hard", "ema", "vqp", "fsq"}
    assert seeds == [0, 1, 2] and ev["samples"] == 1000 and tok["train_images"] == 0
    # the same prior for every tokenizer: the file's prior is the shipped prior config
    assert load_prior_config(None, prior) == load_prior_config(ROOT / "configs/prior_fashion.yaml")
    quick = load_prior_study(ROOT / "configs/study_prior.yaml", quick=True, out=tmp_path / "q", arms=["ddcl_k256*"],
                             prior_seeds=[0])
    assert [a.name for a in quick[1].arms] == ["ddcl_k256_s0"] and quick[5] == [0]
    assert load_prior_config(None, quick[2]).train.steps == 3


def test_study_prior_cpu_is_the_full_study_with_a_shorter_prior(tmp_path):
    """configs/study_prior_cpu.yaml: the same tokenizers, evaluation and prior model; only the
    prior's steps (600) and its evaluation interval change."""
    from ddcl_vq.studies.prior_study import load_prior_study

    full = load_prior_study(ROOT / "configs/study_prior.yaml", out=tmp_path)
    cpu = load_prior_study(ROOT / "configs/study_prior_cpu.yaml", out=tmp_path)
    assert [(a.name, a.config) for a in cpu[1].arms] == [(a.name, a.config) for a in full[1].arms]
    assert cpu[3:6] == full[3:6]
    full_prior, cpu_prior = load_prior_config(None, full[2]), load_prior_config(None, cpu[2])
    assert cpu_prior.model == full_prior.model
    assert (cpu_prior.train.steps, cpu_prior.train.eval_every) == (600, 300)
    assert dataclasses.replace(cpu_prior.train, steps=2000, eval_every=500) == full_prior.train


def test_study_prior_seeds_and_gap_are_the_cpu_study_with_other_tokenizers(tmp_path):
    """configs/study_prior_seeds.yaml and study_prior_gap.yaml sit beside study_prior_cpu.yaml's rows
    in docs/prior.md: their DDCL and peer tokenizers are the CPU study's but for the seed, their
    τ arms DDCL's default but for the schedule, and the prior, tokens and evaluation are the same."""
    from ddcl_vq.studies.prior_study import load_prior_study

    cpu = load_prior_study(ROOT / "configs/study_prior_cpu.yaml", out=tmp_path)
    by_group = {a.group: a.config for a in cpu[1].arms}

    def same_run(config, like):
        return dataclasses.replace(config, run=like.run)

    seeds = load_prior_study(ROOT / "configs/study_prior_seeds.yaml", out=tmp_path)
    assert sorted({a.config.run.seed for a in seeds[1].arms}) == [1, 2] and seeds[5] == [0]
    for arm in seeds[1].arms:
        assert same_run(arm.config, by_group[arm.group]) == by_group[arm.group], arm.name
    gap = load_prior_study(ROOT / "configs/study_prior_gap.yaml", out=tmp_path)
    changed = {"ddcl_tau_anneal_k1024": {"temperature_schedule": "cosine", "temperature_final": 0.01},
               "ddcl_tau_anneal3_k1024": {"temperature_schedule": "cosine", "temperature_final": 0.003}}
    assert {a.group for a in gap[1].arms} == set(changed)
    for arm in gap[1].arms:
        like = by_group["ddcl_k" + arm.group.rsplit("_k", 1)[1]]
        expected = dataclasses.replace(like, quantizer={**like.quantizer, **changed[arm.group]})
        assert same_run(arm.config, like) == expected, arm.name
    for other in (seeds, gap):
        assert other[2] == cpu[2] and other[3:5] == cpu[3:5]


def test_study_table_is_mean_and_sd_over_prior_seeds(tmp_path):
    from ddcl_vq.studies.prior_study import aggregate_priors, markdown, write_plot

    base = {"tokenizer": "ddcl_k256_s0", "type": "ddcl", "num_codes": 256, "psnr": 24.0, "utilization": 1.0,
            "perplexity": 200.0, "log2_k": 8.0, "fd_recon": 1.0}
    runs = [dict(base, prior_seed=s, bits_per_token=b, bits_per_image=64 * b, fd_samples=f, class_accuracy=0.8)
            for s, b, f in ((0, 5.0, 2.0), (1, 6.0, 4.0))]
    runs.append(dict(base, tokenizer="hard_k256_s0", type="hard", prior_seed=0, bits_per_token=4.0,
                     bits_per_image=256.0, fd_samples=3.0, class_accuracy=None))
    groups = aggregate_priors(runs)
    assert [g["name"] for g in groups] == ["ddcl_k256_s0", "hard_k256_s0"] and groups[0]["seeds"] == [0, 1]
    assert groups[0]["bits_per_token"] == 5.5 and groups[0]["bits_per_token_sd"] == pytest.approx(math.sqrt(0.5))
    assert groups[0]["fd_samples"] == 3.0 and groups[1]["bits_per_token_sd"] is None
    table = markdown(groups)
    assert "5.5000 ± 0.7071" in table and "4.0000 ± —" in table
    write_plot(tmp_path / "p.png", groups)
    assert (tmp_path / "p.png").stat().st_size > 1000


def test_table_over_tokenizer_seeds_is_the_spread_between_tokenizers(tmp_path):
    """An arm on several tokenizer seeds gets one row over them: the mean ± sd of each tokenizer's
    (prior-averaged) figures; an arm on one tokenizer seed gets none."""
    from ddcl_vq.studies.prior_study import aggregate_priors, over_tokenizer_seeds, seeds_markdown

    base = {"type": "ddcl", "num_codes": 256, "utilization": 1.0, "perplexity": 200.0, "log2_k": 8.0,
            "fd_recon": 1.0, "bits_per_image": None, "class_accuracy": 0.5}
    runs = []
    for tok_seed, psnr, bits in ((0, 24.0, (3.0, 3.2)), (1, 25.0, (4.0, 4.2)), (2, 26.0, (5.0, 5.2))):
        runs += [dict(base, tokenizer=f"ddcl_k256_s{tok_seed}", group="ddcl_k256", tokenizer_seed=tok_seed,
                      psnr=psnr, prior_seed=p, bits_per_token=b, fd_samples=10.0 * tok_seed)
                 for p, b in enumerate(bits)]
    runs.append(dict(base, tokenizer="hard_k256_s0", group="hard_k256", tokenizer_seed=0, type="hard", psnr=20.0,
                     prior_seed=0, bits_per_token=2.0, fd_samples=7.0))
    rows = over_tokenizer_seeds(aggregate_priors(runs))
    assert [r["name"] for r in rows] == ["ddcl_k256"]
    row = rows[0]
    assert row["seeds"] == [0, 1, 2] and row["n"] == 3
    assert row["bits_per_token"] == pytest.approx(4.1) and row["bits_per_token_sd"] == pytest.approx(1.0)
    assert row["psnr"] == pytest.approx(25.0) and row["fd_samples_sd"] == pytest.approx(10.0)
    assert row["bits_per_image"] is None
    table = seeds_markdown(rows)
    assert "| ddcl_k256 | ddcl | 256 | 0,1,2 (3) | 25.00 ± 1.00 |" in table and "4.1000 ± 1.0000" in table


def test_study_end_to_end_then_report_only_trains_nothing(tmp_path, monkeypatch):
    """A --quick study of one tokenizer and one prior seed; then --report-only over every tokenizer
    and two prior seeds tabulates the finished prior again and names, without training, the rest."""
    from ddcl_vq.studies.prior_study import finished_prior, run_prior_study

    monkeypatch.setenv("DDCL_VQ_CACHE", str(tmp_path / "cache"))
    out, study = tmp_path / "study", ROOT / "configs/study_prior.yaml"
    first = run_prior_study(study, quick=True, out=out, arms=["ddcl_k256*"], prior_seeds=[0], progress=False)
    (run,) = first["runs"]
    assert run["name"] == "ddcl_k256_s0_p0" and run["prior_steps"] == 3 and first["left_out"] == []
    assert (run["group"], run["tokenizer_seed"]) == ("ddcl_k256", 0)
    assert json.loads((out / "table.json").read_text())["over_tokenizer_seeds"] == []  # one tokenizer seed
    summary = (out / "priors" / "ddcl_k256_s0_p0" / "summary.json").read_bytes()
    again = run_prior_study(study, quick=True, out=out, arms=["ddcl_k256*"], prior_seeds=[0], progress=False)
    assert again["runs"] == first["runs"]  # the finished prior is read, not reopened
    assert (out / "priors" / "ddcl_k256_s0_p0" / "summary.json").read_bytes() == summary
    assert 0 < run["bits_per_token"] < 2 * run["log2_k"] and run["fd_samples"] > 0
    report = run_prior_study(study, quick=True, out=out, prior_seeds=[0, 1], progress=False, report_only=True)
    assert [r["name"] for r in report["runs"]] == ["ddcl_k256_s0_p0"]
    assert report["runs"][0]["bits_per_token"] == run["bits_per_token"]
    assert {"ddcl_k256_s0_p1", "hard_k256_s0", "fsq_k1024_s0"} <= set(report["left_out"])
    assert sorted(p.name for p in (out / "priors").iterdir()) == ["ddcl_k256_s0_p0"]
    assert sorted(p.name for p in (out / "tokenizers" / "runs").iterdir()) == ["ddcl_k256_s0"]
    assert "Not finished, left out of the table: ddcl_k256_s0_p1, " in (out / "table.md").read_text()

    prior_dir = out / "priors" / "ddcl_k256_s0_p0"  # finished means: all steps, with the same settings
    assert finished_prior(load_prior_config(prior_dir / "config.yaml"))["step"] == 3
    assert finished_prior(load_prior_config(prior_dir / "config.yaml", ["train.steps=4"])) is None
    assert finished_prior(load_prior_config(prior_dir / "config.yaml", ["model.dropout=0.2"])) is None
    assert finished_prior(load_prior_config(prior_dir / "config.yaml", ["train.log_every=2"]))["step"] == 3
