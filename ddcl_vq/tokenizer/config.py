"""The training config: YAML in, validated dataclasses out, dotted overrides::

    cfg = load_config("configs/fashion_ddcl.yaml", ["train.steps=200", "quantizer.temperature=0.02"])

The ``model`` section is the encoder's keyword arguments and defaults, the ``quantizer`` section the quantizer classes'
(:data:`QUANTIZER_CLASSES`); which settings a resumed run may change is :data:`RESUMABLE`.
"""
from __future__ import annotations

import dataclasses
import inspect
import json
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

from ddcl_vq import EMAVQ, DDCLQuantizer, FVQQuantizer, HardVQ, IBQQuantizer
from ddcl_vq.ibq import IBQ_LOGITS
from ddcl_vq.ddcl.arguments import DDCL_CHOICES
from ddcl_vq.models.vqvae import QUANTIZER_TYPES, Encoder

from ddcl_vq.common.config import (ConfigError, Rules, apply, check, check_finite, did_you_mean, differences,
                                   dump_config, keys_of, read_yaml_mapping)
from ddcl_vq.common.config import apply_overrides as _apply_overrides
from ddcl_vq.common.data import NATURAL_TEST_PHOTOS, NATURAL_TRAIN_PHOTOS, check_photos
from ddcl_vq.common.rundir import RunDirError

__all__ = ["ConfigError", "differences", "dump_config"]  # re-exported: what the commands import from here


def signature_fields(fn: Any, skip: Sequence[str] = ()) -> List[Tuple[str, Any, Any]]:
    """``(name, type, field(default=...))`` for every keyword argument of ``fn`` with a default, except ``skip``."""
    hints = typing.get_type_hints(fn)
    params = inspect.signature(fn).parameters.values()
    return [(p.name, hints.get(p.name, Any), field(default=p.default)) for p in params if p.name != "self"
            and p.name not in skip and p.default is not p.empty and p.kind in (p.KEYWORD_ONLY, p.POSITIONAL_OR_KEYWORD)]


@dataclass
class RunConfig:
    name: str = "fashion_ddcl"
    dir: str = "runs/fashion_ddcl"          # where config.yaml, checkpoints/, tb/, metrics.jsonl go
    seed: int = 0


@dataclass
class DataConfig:
    name: str = "fashion_mnist"             # fashion_mnist | mnist | cifar10 | image_folder | natural_patches | digits
    root: str = "data"                       # torchvision downloads / image_folder root (with train/ and test/)
    image_size: int = 32                     # images are padded (28 -> 32) or resized/cropped to this
    batch_size: int = 128                    # global batch (split evenly over processes)
    download: bool = True                    # let torchvision download when the files are missing
    patches_per_image: int = 2000            # natural_patches only
    # natural_patches only: the scikit-image photographs of each split (ddcl_vq/common/data.py PHOTOGRAPHS; no overlap)
    train_photos: List[str] = field(default_factory=lambda: list(NATURAL_TRAIN_PHOTOS))
    test_photos: List[str] = field(default_factory=lambda: list(NATURAL_TEST_PHOTOS))
    num_workers: Optional[int] = None       # DataLoader workers; null = auto (data.resolve_workers)
    augment: str = "none"                    # image_folder train split: none (centre crop) | crop_flip (augment.py)


#: model sizes: the encoder's keyword arguments and defaults (image channels aside), then the VQGAN's
VQGAN_MODEL_FIELDS = [("arch", str, field(default="vqvae")), ("ch", int, field(default=128)),
                      ("ch_mult", List[int], field(default_factory=lambda: [1, 1, 2, 2, 4])),
                      ("attn_resolutions", List[int], field(default_factory=lambda: [16])),
                      ("z_channels", int, field(default=256)), ("norm_groups", int, field(default=32))]
ModelConfig = dataclasses.make_dataclass("ModelConfig", signature_fields(Encoder.__init__, skip=("in_channels",))
                                         + VQGAN_MODEL_FIELDS)
ModelConfig.__module__ = __name__
ModelConfig.__doc__ = "The model's sizes: ``Encoder``/``Decoder`` keyword arguments and defaults (not image channels)."

#: quantizer.type -> the class whose keyword arguments (and defaults) are the config's quantizer.* keys
QUANTIZER_CLASSES = {"ddcl": DDCLQuantizer, "hard": HardVQ, "ema": EMAVQ, "ibq": IBQQuantizer, "fvq": FVQQuantizer}
#: constructor arguments that are not quantizer.* keys, and where their value comes from
NOT_IN_CONFIG = {"num_codes": "quantizer.num_codes", "dim": "model.latent_dim", "channel_dim": "1 (channel-first)",
                 "schedule_steps": "train.steps", "chunk_size": "the constructor default",
                 "chunk_threshold_bytes": "the constructor default", "eps": "the constructor default"}
#: keys several quantizers share whose defaults differ between them: None = "the quantizer's own default"
PER_QUANTIZER_DEFAULT = ("decay",)


def _quantizer_fields() -> List[Tuple[str, Any, Any]]:
    fields: Dict[str, Tuple[str, Any, Any]] = {"type": ("type", str, field(default="ddcl")),
                                               "num_codes": ("num_codes", int, field(default=512))}
    owners: Dict[str, str] = {}
    for qtype, cls in QUANTIZER_CLASSES.items():
        for name, annotation, f in signature_fields(cls.__init__, skip=tuple(NOT_IN_CONFIG) + PER_QUANTIZER_DEFAULT):
            if name in fields:  # a key two quantizers share (beta) has one default
                if name in owners and fields[name][2].default != f.default:
                    raise TypeError(f"quantizer.{name}: {owners[name]} and {qtype} default to "
                                    f"{fields[name][2].default!r} and {f.default!r}; add it to PER_QUANTIZER_DEFAULT")
                continue
            fields[name], owners[name] = (name, annotation, f), qtype
    fields.update({name: (name, Optional[float], field(default=None)) for name in PER_QUANTIZER_DEFAULT})
    # the vector-quantize-pytorch peers: fsq's grid (None: from num_codes), the others' keyword arguments as they are
    fields.update(vqp=("vqp", Dict[str, Any], field(default_factory=dict)),
                  fsq_levels=("fsq_levels", Optional[List[int]], field(default=None)),
                  simvq=("simvq", Dict[str, Any], field(default_factory=dict)),
                  lfq=("lfq", Dict[str, Any], field(default_factory=dict)))
    return list(fields.values())


QuantizerConfig = dataclasses.make_dataclass("QuantizerConfig", _quantizer_fields())
QuantizerConfig.__module__ = __name__
QuantizerConfig.__doc__ = ("The quantizer: ``type``, ``num_codes`` (K), every quantizer class's keyword arguments with "
                           "their defaults (see QUANTIZER_CLASSES; a shared one like beta once), decay (None: the "
                           "quantizer's default) and the peers' keyword arguments (vqp, simvq, lfq).")


def quantizer_keys(qtype: str) -> List[str]:
    """The quantizer.* keys that are constructor arguments of ``qtype``'s class (``[]`` for vqp)."""
    params = inspect.signature(QUANTIZER_CLASSES[qtype].__init__).parameters if qtype in QUANTIZER_CLASSES else {}
    return [f.name for f in dataclasses.fields(QuantizerConfig) if f.name in params and f.name not in NOT_IN_CONFIG]


@dataclass
class TrainConfig:
    steps: int = 1000
    lr: float = 2e-3                         # encoder/decoder learning rate (AdamW)
    codebook_lr_ratio: float = 3.0           # rho: lr of gradient-trained quantizer params; none in ddcl, ema
    weight_decay: float = 0.0
    lr_schedule: str = "cosine"              # constant | cosine (to 10% of lr) | anneal (FVQ's: skeleton.lr_schedule)
    quantizer_loss_weight: float = 1.0
    grad_clip: float = 1.0                   # max global grad norm; 0 = off
    amp: str = "none"                        # none | bf16 | fp16 (autocast; the quantizer stays float32)
    log_every: int = 25
    checkpoint_every: int = 250
    image_every: int = 500
    usage_window: int = 100                  # steps per windowed utilization / dead-code figure
    eval_images: int = 10000                 # test images for the end-of-run summary (0 = skip)
    device: str = "auto"                     # auto | cpu | cuda
    threads: Optional[int] = None            # torch CPU threads per process; null = auto (threads.py), kept on resume
    init_from: Optional[str] = None          # a new run from an exported model folder or Hub id (tokens.py)


@dataclass
class LossConfig:
    """The training loss (ddcl_vq.tokenizer.losses): the defaults are the plain pixel MSE."""
    pixel: str = "l2"                        # l1 | l2
    pixel_weight: float = 1.0
    perceptual_weight: float = 0.0           # LPIPS (frozen, real ImageNet trunk weights); 0 = off
    perceptual_net: str = "vgg"              # vgg (taming) | alex
    disc_weight: float = 0.0                 # PatchGAN adversarial loss weight (times the adaptive lambda); 0 = off
    disc_start: int = 0                      # the training step the discriminator (and its loss) switches on
    disc_loss: str = "hinge"                 # hinge | vanilla | non_saturating
    disc_layers: int = 3
    disc_channels: int = 64
    disc_lr: Optional[float] = None          # the discriminator's Adam lr (beta 0.5, 0.9); null = train.lr
    adaptive_weight: bool = True             # lambda = ||grad L_rec|| / (||grad L_G|| + 1e-4), decoder's last layer


@dataclass
class Config:
    run: RunConfig = field(default_factory=RunConfig)
    data: DataConfig = field(default_factory=DataConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    quantizer: QuantizerConfig = field(default_factory=QuantizerConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    loss: LossConfig = field(default_factory=LossConfig)

    def to_dict(self) -> Dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, raw: Dict[str, Any], *, saved: bool = False) -> "Config":
        """``saved``: a run's resolved config: exactly this version's keys (:func:`check_saved_keys`), and no
        :func:`validate_training` (it has trained)."""
        cfg = cls()
        if saved:
            check_saved_keys(raw)
        apply(cfg, raw or {}, candidates=all_keys())
        validate(cfg)
        if not saved:
            validate_training(cfg)
        return cfg


CHOICES = {
    "data.name": ("fashion_mnist", "mnist", "cifar10", "image_folder", "natural_patches", "digits"),
    "quantizer.type": tuple(QUANTIZER_TYPES), "quantizer.logits": IBQ_LOGITS,
    "quantizer.distance": ("euclidean", "cosine"),  # HardVQ's (it has no public tuple yet)
    "train.lr_schedule": ("constant", "cosine", "anneal"), "train.amp": ("none", "bf16", "fp16"),
    "train.device": ("auto", "cpu", "cuda"), "model.arch": ("vqvae", "vqgan"), "data.augment": ("none", "crop_flip"),
    "loss.pixel": ("l1", "l2"), "loss.perceptual_net": ("vgg", "alex"),
    "loss.disc_loss": ("hinge", "vanilla", "non_saturating"),
}
CHOICES.update({f"quantizer.{name}": values for name, values in DDCL_CHOICES.items()})  # the library's own tuples
POSITIVE = {"data.image_size", "data.batch_size", "data.patches_per_image", "model.channels", "model.res_hidden",
            "model.num_downsamples", "model.latent_dim", "quantizer.num_codes", "quantizer.temperature", "train.steps",
            "train.lr", "train.codebook_lr_ratio", "train.log_every", "train.checkpoint_every", "train.image_every",
            "train.usage_window", "train.threads", "model.ch", "model.ch_mult", "model.z_channels", "model.norm_groups",
            "loss.disc_layers", "loss.disc_channels", "quantizer.entropy_temperature"}
NON_NEGATIVE = {"model.num_res_blocks", "data.num_workers", "quantizer.beta", "quantizer.dead_code_threshold",
                "quantizer.warmup_steps", "quantizer.revive_threshold", "quantizer.entropy_weight",
                "train.weight_decay", "train.quantizer_loss_weight", "train.grad_clip", "train.eval_images",
                "model.attn_resolutions", "loss.pixel_weight", "loss.perceptual_weight", "loss.disc_weight",
                "loss.disc_start"}
RULES = Rules(CHOICES, POSITIVE, NON_NEGATIVE, seeds={"run.seed"})
#: the version whose runs a saved config with other keys comes from (this one's keys changed in 0.2.0)
OLD_VERSION = "0.1.0"


def all_keys(obj: Any = None, prefix: str = "") -> List[str]:
    return keys_of(Config() if obj is None else obj, prefix)


def check_not_prior(raw: Dict[str, Any], where: str) -> None:
    """A prior run's config (data.train_tokens) is named as such, not as a config with unknown keys."""
    if isinstance(raw.get("data"), dict) and "train_tokens" in raw["data"]:
        raise ConfigError(f"{where} is the config of a prior run (ddcl-vq prior train: data.train_tokens), not of a "
                          "tokenizer run; evaluate it with ddcl-vq prior evaluate RUN_DIR")


def check_saved_keys(raw: Any, where: str = "the run's config") -> None:
    """ConfigError unless a run's saved config has exactly this version's keys (an older run's would be misread)."""
    if not isinstance(raw, dict):
        return  # apply() says what is wrong with it
    check_not_prior(raw, where)
    given = set()
    for section, values in raw.items():
        given |= {f"{section}.{key}" for key in values} if isinstance(values, dict) else {str(section)}
    valid = set(all_keys())
    gone, new = sorted(given - valid), sorted(valid - given)
    if gone or new:
        what = (f"{', '.join(gone[:4])}{' ...' if len(gone) > 4 else ''} {'was' if len(gone) == 1 else 'were'} retired "
                "or renamed" if gone else f"{', '.join(new[:4])}{' ...' if len(new) > 4 else ''} existed")
        raise ConfigError(f"{where} was written by ddcl-vq {OLD_VERSION} before {what}; evaluate it with ddcl-vq "
                          "0.1.x or retrain it with this version")


def validate(cfg: Config) -> None:
    check_finite(cfg)
    check(cfg, RULES)
    check_photos(cfg.data.train_photos, cfg.data.test_photos)
    m, lc, size = cfg.model, cfg.loss, cfg.data.image_size
    factor = 2 ** m.num_downsamples
    if m.arch == "vqgan":  # the image size a multiple of 2**(len(ch_mult) - 1), channels divisible by the groups
        if not m.ch_mult:
            raise ConfigError("config key 'model.ch_mult': expected at least one multiplier, got []")
        factor = 2 ** (len(m.ch_mult) - 1)
        if size % factor:
            raise ConfigError(f"config key 'data.image_size': expected a multiple of {factor} (the VQGAN encoder "
                              f"halves the image len(model.ch_mult) - 1 = {len(m.ch_mult) - 1} times), got {size}")
        bad = [m.ch * k for k in m.ch_mult if (m.ch * k) % m.norm_groups]
        if bad or m.z_channels < 1:
            raise ConfigError(f"config key 'model.norm_groups': expected every block width model.ch x model.ch_mult "
                              f"to be a multiple of {m.norm_groups} (GroupNorm), got widths {bad}")
    elif size % factor:
        lower, upper = size // factor * factor, (size // factor + 1) * factor
        halvings = (size & -size).bit_length() - 1  # how often size itself can be halved
        hint = (f"e.g. {lower} or {upper}" if lower else
                f"e.g. {upper}, or model.num_downsamples={halvings} or fewer for {size}-pixel images")
        raise ConfigError(f"config key 'data.image_size': expected a multiple of {factor} (the model halves the "
                          f"image model.num_downsamples={m.num_downsamples} times), got {size}; {hint}")
    if lc.disc_lr is not None and not lc.disc_lr > 0:
        raise ConfigError(f"config key 'loss.disc_lr': expected a value > 0 (or null for train.lr), got {lc.disc_lr!r}")
    if lc.disc_weight > 0 and size < 3 * 2 ** lc.disc_layers:
        raise ConfigError(f"config key 'loss.disc_layers': a {lc.disc_layers}-layer PatchGAN needs images of at "
                          f"least {3 * 2 ** lc.disc_layers}px, got data.image_size={size}; lower loss.disc_layers")
    if cfg.data.augment != "none" and cfg.data.name != "image_folder":
        raise ConfigError(f"config key 'data.augment': {cfg.data.augment!r} is for data.name image_folder, got "
                          f"{cfg.data.name!r}; use data.augment=none")
    decay = cfg.quantizer.decay
    if decay is not None and not 0 <= decay < 1:
        raise ConfigError(f"config key 'quantizer.decay': expected 0 <= decay < 1 (or null for the quantizer's "
                          f"default), got {decay!r}")
    if not cfg.quantizer.revive_threshold < 1:
        raise ConfigError("config key 'quantizer.revive_threshold': expected a value < 1, got "
                          f"{cfg.quantizer.revive_threshold!r}")
    tf = cfg.quantizer.temperature_final
    if cfg.quantizer.temperature_schedule != "constant" and (tf is None or not tf > 0):
        raise ConfigError("config key 'quantizer.temperature_final': expected a value > 0 when "
                          f"quantizer.temperature_schedule is {cfg.quantizer.temperature_schedule!r}, got {tf!r}")
    for key, qtype in (("vqp", "vqp"), ("simvq", "simvq"), ("lfq", "lfq"), ("fsq_levels", "fsq")):
        if cfg.quantizer.type != qtype and getattr(cfg.quantizer, key):
            raise ConfigError(f"config key 'quantizer.{key}': only used with quantizer.type {qtype!r}, got type "
                              f"{cfg.quantizer.type!r}")


def validate_training(cfg: Config) -> None:
    """Refuse settings with which a training would learn nothing or silently leave a part out."""
    lc, m = cfg.loss, cfg.model
    if lc.pixel_weight == 0 and lc.perceptual_weight == 0:
        extra = (" (and loss.disc_weight alone cannot: its adaptive weight is 0 without a reconstruction loss)"
                 if lc.disc_weight > 0 and lc.adaptive_weight else "")
        raise ConfigError(f"config keys 'loss.pixel_weight' and 'loss.perceptual_weight' are both 0 (loss.disc_weight "
                          f"{lc.disc_weight:g}): no loss compares the reconstruction with the image, so the model "
                          f"would learn nothing{extra}; set loss.pixel_weight > 0 (1.0 is the default)")
    if lc.disc_weight > 0 and lc.disc_start >= cfg.train.steps:
        raise ConfigError(f"config key 'loss.disc_start': {lc.disc_start} is not before train.steps="
                          f"{cfg.train.steps}, so the discriminator would never switch on; set loss.disc_start below "
                          "train.steps (the recipe switches it on halfway) or loss.disc_weight=0")
    if m.arch == "vqgan":
        levels = [cfg.data.image_size // 2 ** i for i in range(len(m.ch_mult))]
        missing = [r for r in m.attn_resolutions if r not in levels]
        if missing:
            raise ConfigError(f"config key 'model.attn_resolutions': {missing} match no level of the VQGAN (its "
                              f"blocks work at {levels} pixels for data.image_size={cfg.data.image_size} and "
                              f"model.ch_mult={list(m.ch_mult)}), so no attention would be added there; list some "
                              "of those, or [] for attention only in the middle block")


def _unknown_key(key: str) -> ConfigError:
    return ConfigError(f"unknown config key {key!r}; {did_you_mean(key, all_keys())}")


def apply_overrides(raw: Dict[str, Any], overrides: Sequence[str]) -> Dict[str, Any]:
    """A copy of ``raw`` with every training-config override set (a quantizer.vqp/simvq/lfq keyword passes)."""
    open_sections = ("quantizer.vqp", "quantizer.simvq", "quantizer.lfq")
    return _apply_overrides(raw, overrides, all_keys(), _unknown_key, open_sections)


def load_config(path: Optional[str | Path] = None, overrides: Sequence[str] = (), *, saved: bool = False) -> Config:
    """YAML file (optional) + dotted overrides -> validated Config (``saved``: :meth:`Config.from_dict`)."""
    raw: Dict[str, Any] = read_yaml_mapping(Path(path), "config file") if path is not None else {}
    check_not_prior(raw, f"config file {str(path)!r}")
    if saved:
        check_saved_keys(raw, f"config file {str(path)!r}")
    return Config.from_dict(apply_overrides(raw, overrides), saved=saved)


#: settings a resumed run may change (train.steps: not below the steps trained; data.root: not for image_folder)
RESUMABLE = ("train.steps", "train.log_every", "train.image_every", "train.checkpoint_every", "train.eval_images",
             "train.usage_window", "train.device", "train.threads", "data.num_workers", "data.download", "data.root",
             "run.dir", "run.name", "quantizer.implementation")


def saved_config(state: Dict[str, Any], run_dir: Path) -> Optional[Config]:
    """The resolved config a checkpoint was trained with (else RUN_DIR/config.yaml's, else None)."""
    raw = state.get("config")
    try:
        if isinstance(raw, dict):
            return Config.from_dict(raw, saved=True)
        if (run_dir / "config.yaml").is_file():
            return load_config(run_dir / "config.yaml", saved=True)
    except ConfigError as err:
        raise RunDirError(f"run directory {str(run_dir)!r}: the config its checkpoint was trained with cannot be "
                          f"read by this version ({err}); start a new run with another run.dir") from None
    return None


def check_resume(saved: Config, cfg: Config, trained_steps: int, run_dir: Path) -> List[str]:
    """RunDirError when ``saved`` and ``cfg`` differ beyond :data:`RESUMABLE` keys; -> notes on allowed changes."""
    refused, notes, fewer = [], [], None  # changes refused (key, old, new); notes; a train.steps below the steps done
    no_disc = saved.loss.disc_weight == cfg.loss.disc_weight == 0  # the discriminator's settings do nothing
    for key, old, new in differences(saved, cfg):
        if no_disc and key.startswith(("loss.disc_", "loss.adaptive_weight")):
            continue
        if key not in RESUMABLE or (key == "data.root" and cfg.data.name == "image_folder"):
            refused.append((key, old, new))
        elif key == "train.steps" and new < trained_steps:
            fewer = (key, old, new)
        elif key == "train.steps":
            stretched = [what for what, on in (("the learning-rate schedule", cfg.train.lr_schedule != "constant"),
                                               ("the temperature schedule", cfg.quantizer.type == "ddcl"
                                                and cfg.quantizer.temperature_schedule != "constant")) if on]
            if stretched:
                notes.append(f"train.steps {old} -> {new}: {' and '.join(stretched)} "
                             f"{'was' if len(stretched) == 1 else 'were'} laid out for {old} steps; the learning rate "
                             f"follows {new} steps from here (a temperature schedule stays where it ended)")
    if fewer and not refused:
        raise RunDirError(f"run directory {str(run_dir)!r} holds a run that has trained {trained_steps} steps; "
                          f"train.steps={fewer[2]} is fewer. Give train.steps >= {trained_steps}, or another run.dir "
                          "for a new run")
    if refused:
        refused += [fewer] if fewer else []
        changes = ", ".join(f"{key} {old!r} -> {new!r}" for key, old, new in refused)
        allowed = ", ".join(k if k != "train.steps" else f"train.steps (at least {trained_steps})" for k in RESUMABLE)
        raise RunDirError(
            f"run directory {str(run_dir)!r} holds a run trained {trained_steps} steps with another config; resuming "
            f"it would mix the two ({changes}). Only these may change on resume: {allowed}. To train with the new "
            f"settings, start a new run (another run.dir, or delete {str(run_dir)!r}); to continue this run as it "
            f"was: ddcl-vq train --config {str(run_dir / 'config.yaml')}")
    return notes


def finished_summary(run_dir: Path, step: int, cfg: Config) -> Optional[Dict[str, Any]]:
    """RUN_DIR/summary.json when it describes the run finished at ``step`` completely (evaluation included)."""
    try:
        summary = json.loads((run_dir / "summary.json").read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(summary, dict) or summary.get("step") != step or "evaluation_error" in summary:
        return None
    if summary.get("eval_images", cfg.train.eval_images) != cfg.train.eval_images:
        return None  # asked for another evaluation
    return None if cfg.train.eval_images > 0 and summary.get("hard") is None else summary


def run_dir_of_config(config_path: str | Path) -> Optional[Path]:
    """RUN_DIR when ``config_path`` is RUN_DIR/config.yaml next to checkpoints/ or metrics.jsonl; else None."""
    path = Path(config_path)
    folder = path.parent
    if path.name != "config.yaml" or not path.is_file():
        return None
    return folder if (folder / "checkpoints").is_dir() or (folder / "metrics.jsonl").is_file() else None


def follow_run_dir(cfg: Config, config_path: str | Path, overrides: Sequence[str] = ()) -> Optional[str]:
    """``--config RUN_DIR/config.yaml`` continues THAT run directory (a copied or moved run) unless ``run.dir=`` is
    given; -> a note when the saved run.dir was another folder."""
    folder = run_dir_of_config(config_path)
    if folder is None or any(text.split("=", 1)[0].strip() == "run.dir" for text in overrides):
        return None
    saved = cfg.run.dir
    if saved.strip() and Path(saved).resolve() == folder.resolve():
        return None
    cfg.run.dir = str(folder)
    return (f"{str(Path(config_path))!r} says run.dir {saved!r}, but it lives in the run directory {str(folder)!r} "
            f"(a copied or moved run): training {str(folder)!r}, the run this config belongs to (give run.dir=... "
            "to train another folder)")
