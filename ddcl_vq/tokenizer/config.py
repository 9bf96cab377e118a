"""The training config: YAML in, validated settings out, dotted overrides::

    cfg = load_config("configs/fashion_ddcl.yaml", ["train.steps=200", "quantizer.temperature=0.02"])

``run``, ``data``, ``train``, ``loss``: dataclasses; ``model``, ``quantizer``: plain dicts, the keyword arguments of the
encoder/decoder (``model.arch``) and of the quantizer class (``quantizer.type``: ``QUANTIZER_TYPES``) with their
defaults, checked by those constructors; what config.json stores (:func:`build_model`). Resumable: :data:`RESUMABLE`.
"""
from __future__ import annotations

import dataclasses
import inspect
import json
import re
import typing
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch

from ddcl_vq.models.vqvae import CONFIG_FORMAT, QUANTIZER_TYPES, VQVAE, architecture, check_model_arguments

from ddcl_vq.common.config import (ConfigError, Rules, apply, check, check_finite, coerce, config_key, did_you_mean,
                                   differences, dump_config, keys_of, read_yaml_mapping)
from ddcl_vq.common.config import apply_overrides as _apply_overrides
from ddcl_vq.common.data import NATURAL_TEST_PHOTOS, NATURAL_TRAIN_PHOTOS, check_photos
from ddcl_vq.common.errors import one_line
from ddcl_vq.common.rundir import RunDirError
from ddcl_vq.common.skeleton import lr_schedule

__all__ = ["ConfigError", "differences", "dump_config"]  # re-exported: what the commands import from here

#: what the config adds to the quantizer constructors' own defaults (the model's: arch vqvae)
QUANTIZER_DEFAULTS: Dict[str, Any] = {"type": "ddcl", "num_codes": 512}
ARCHS = ("vqvae", "vqgan")
#: constructor arguments that are no config key (the data's channels, image size, latent_dim, 1, train.steps)
NOT_IN_CONFIG = ("in_channels", "out_channels", "resolution", "dim", "channel_dim", "schedule_steps")
#: ddcl-vq 0.2.0 keys that are gone (a config written for 0.2.0 is told where they went)
MOVED = {f"quantizer.{name}": f"0.2.0's quantizer.{name} section is gone: its keys go straight under quantizer "
                              f"(quantizer.type {name})" for name in ("vqp", "simvq", "lfq")}
MOVED["quantizer.fsq_levels"] = "0.2.0's quantizer.fsq_levels is now quantizer.levels (FSQQuantizer's argument)"


def constructor_keys(cls: type) -> Tuple[Dict[str, inspect.Parameter], Optional[List[str]]]:
    """(``cls``'s keyword arguments but :data:`NOT_IN_CONFIG`, the keywords its ``**kwargs`` hands on: to its
    vector-quantize-pytorch class ``cls.peer``, or ``cls.level_options``; [] without ``**kwargs``, None when they
    cannot be known)."""
    params = inspect.signature(cls.__init__).parameters
    named = {name: p for name, p in params.items() if name != "self" and name not in NOT_IN_CONFIG
             and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
    if not any(p.kind is p.VAR_KEYWORD for p in params.values()):
        return named, []
    if hasattr(cls, "level_options"):  # residual/grouped DDCL: DDCLQuantizer's keywords, for every codebook
        return named, [k for k in cls.level_options if k not in named]
    try:
        import vector_quantize_pytorch
        peer = inspect.signature(getattr(vector_quantize_pytorch, cls.peer).__init__).parameters
    except (ImportError, AttributeError):
        return named, None  # the quantizer says how to install it
    free = any(p.kind is p.VAR_KEYWORD for p in peer.values())
    return named, None if free else [p for p in peer if p not in ("self", "dim", "codebook_size", "channel_first")
                                     and p not in named]


def resolve_section(section: str, raw: Any, cls: type, defaults: Dict[str, Any],
                    foreign: Sequence[str] = ()) -> Dict[str, Any]:
    """``raw`` checked against ``cls``'s signature, filled with ``defaults``, then the constructor's (an unknown key
    names the nearest one, a value of another type what was expected); ``foreign`` keys (another arch's): left out."""
    if not isinstance(raw, dict):
        raise ConfigError(f"{config_key(section)}: expected a mapping, got {raw!r}")
    named, extra = constructor_keys(cls)
    hints = typing.get_type_hints(cls.__init__)
    out = {**defaults, **{k: list(p.default) if isinstance(p.default, tuple) else p.default
                          for k, p in named.items() if p.default is not p.empty and k not in defaults}}
    for key, value in raw.items():
        name = f"{section}.{key}"
        if key in named:
            out[key] = coerce(name, value, hints.get(key, Any))
        elif key in defaults or extra is None or key in extra:  # type / arch (checked), a peer's keyword
            out[key] = value
        elif key not in foreign:
            valid = [f"{section}.{k}" for k in dict.fromkeys([*defaults, *named, *extra])]
            raise ConfigError(f"unknown {config_key(name)}; {MOVED.get(name) or did_you_mean(name, valid)}")
    return out


def choice(section: str, key: str, raw: Any, default: str, allowed: Sequence[str]) -> str:
    value = raw.get(key, default) if isinstance(raw, dict) else None
    if value not in allowed:
        raise ConfigError(f"{config_key(f'{section}.{key}')}: expected one of {list(allowed)}, got {value!r}")
    return value


def refused(section: str, keys: Sequence[str], err: Exception, what: str) -> ConfigError:
    """A constructor's ValueError as a ConfigError naming the key its message names (else the section)."""
    text = one_line(err) or type(err).__name__
    named = [k for k in keys if re.search(rf"\b{k}\b", text)]
    where = config_key(f"{section}.{named[0]}") if named else f"config keys {section}.*: {what} refuses these settings"
    return ConfigError(f"{where}: {text}")


def resolve_model(raw: Any) -> Dict[str, Any]:
    """The ``model`` section: ``arch`` and the encoder's keyword arguments (defaults filled, sizes checked)."""
    arch = choice("model", "arch", raw, "vqvae", ARCHS)
    other = constructor_keys(architecture(ARCHS[1 - ARCHS.index(arch)])[0])[0]
    model = resolve_section("model", raw, architecture(arch)[0], {"arch": arch}, foreign=other)
    try:
        check_model_arguments(model)
    except ValueError as err:
        raise refused("model", list(model), err, "the model") from None
    return model


def resolve_quantizer(raw: Any) -> Dict[str, Any]:
    """The ``quantizer`` section: ``type`` and that class's keyword arguments (defaults filled, types checked)."""
    qtype = choice("quantizer", "type", raw, QUANTIZER_DEFAULTS["type"], tuple(QUANTIZER_TYPES))
    return resolve_section("quantizer", raw, QUANTIZER_TYPES[qtype], {**QUANTIZER_DEFAULTS, "type": qtype})


def quantizer_arguments(q: Dict[str, Any], steps: int) -> Dict[str, Any]:
    """The quantizer's keyword arguments: the section but ``type``, and ``schedule_steps`` = train.steps if taken."""
    takes = "schedule_steps" in inspect.signature(QUANTIZER_TYPES[q["type"]].__init__).parameters
    return {**{k: v for k, v in q.items() if k != "type"}, **({"schedule_steps": steps} if takes else {})}


def check_quantizer(q: Dict[str, Any], dim: int, steps: int) -> None:
    """The quantizer's own argument checks, run on the meta device (nothing allocated); a peer's: when built."""
    cls, kwargs = QUANTIZER_TYPES[q["type"]], quantizer_arguments(q, steps)
    if hasattr(cls, "peer"):
        return
    try:
        with torch.device("meta"), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            cls(dim=dim, **kwargs)
    except (ValueError, TypeError) as err:
        raise refused("quantizer", list(kwargs), err, f"the {q['type']} quantizer") from None


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
    model: Dict[str, Any] = field(default_factory=lambda: resolve_model({}), metadata={"section": True})
    quantizer: Dict[str, Any] = field(default_factory=lambda: resolve_quantizer({}), metadata={"section": True})
    train: TrainConfig = field(default_factory=TrainConfig)
    loss: LossConfig = field(default_factory=LossConfig)

    def to_dict(self) -> Dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, raw: Dict[str, Any], *, saved: bool = False) -> "Config":
        """``saved``: a run's resolved config: exactly this version's keys (:func:`check_saved_keys`), and no
        :func:`validate_training` (it has trained)."""
        return cls.resolved(check_saved_keys(raw) if saved else raw, training=not saved)

    @classmethod
    def resolved(cls, raw: Dict[str, Any], training: bool = True) -> "Config":
        """``raw`` applied to the defaults, its model and quantizer sections resolved, validated."""
        cfg = cls()
        apply(cfg, raw or {}, candidates=all_keys())
        cfg.model, cfg.quantizer = resolve_model(cfg.model), resolve_quantizer(cfg.quantizer)
        validate(cfg)
        if training:
            validate_training(cfg)
        return cfg


CHOICES = {
    "data.name": ("fashion_mnist", "mnist", "cifar10", "image_folder", "natural_patches", "digits"),
    "train.lr_schedule": ("constant", "cosine", "anneal"), "train.amp": ("none", "bf16", "fp16"),
    "train.device": ("auto", "cpu", "cuda"), "data.augment": ("none", "crop_flip"),
    "loss.pixel": ("l1", "l2"), "loss.perceptual_net": ("vgg", "alex"),
    "loss.disc_loss": ("hinge", "vanilla", "non_saturating"),
}
POSITIVE = {"data.image_size", "data.batch_size", "data.patches_per_image", "train.steps", "train.lr",
            "train.codebook_lr_ratio", "train.log_every", "train.checkpoint_every", "train.image_every",
            "train.usage_window", "train.threads", "loss.disc_layers", "loss.disc_channels"}
NON_NEGATIVE = {"data.num_workers", "train.weight_decay", "train.quantizer_loss_weight", "train.grad_clip",
                "train.eval_images", "loss.pixel_weight", "loss.perceptual_weight", "loss.disc_weight",
                "loss.disc_start"}
RULES = Rules(CHOICES, POSITIVE, NON_NEGATIVE, seeds={"run.seed"})
#: the version whose runs a saved config with other keys comes from (0.2.0's are migrated: :func:`migrate_0_2_0`)
OLD_VERSION = "0.1.0"
#: what every resolved ddcl-vq 0.2.0 config has: one quantizer section for all types, one model section for both archs
SHAPE_0_2_0 = {"quantizer": ("vqp", "simvq", "lfq", "fsq_levels"), "model": ("channels", "ch_mult")}


def all_keys(obj: Any = None, prefix: str = "") -> List[str]:
    return keys_of(Config() if obj is None else obj, prefix)


def check_not_prior(raw: Dict[str, Any], where: str) -> None:
    """A prior run's config (data.train_tokens) is named as such, not as a config with unknown keys."""
    if isinstance(raw.get("data"), dict) and "train_tokens" in raw["data"]:
        raise ConfigError(f"{where} is the config of a prior run (ddcl-vq prior train: data.train_tokens), not of a "
                          "tokenizer run; evaluate it with ddcl-vq prior evaluate RUN_DIR")


def migrate_0_2_0(raw: Any) -> Any:
    """A run config of ddcl-vq 0.2.0 (every type's and arch's keys in one section each) in this version's form: the
    keys of its quantizer.type and model.arch, a peer's section (quantizer.vqp: {...}) flat, fsq_levels -> levels."""
    if not isinstance(raw, dict) or not all(isinstance(raw.get(s), dict) and all(k in raw[s] for k in keys)
                                            for s, keys in SHAPE_0_2_0.items()):
        return raw
    q, m = raw["quantizer"], raw["model"]
    qtype, arch = q.get("type"), m.get("arch", "vqvae")
    if qtype not in QUANTIZER_TYPES or arch not in ARCHS:
        return raw  # resolving it says what is wrong
    # the arguments 0.2.0 left out (eps, chunk_size, ...) at what it passed them: the constructor's defaults
    new_q, model = resolve_quantizer({"type": qtype}), resolve_model({"arch": arch})
    new_q.update({k: v for k, v in q.items() if k in new_q and not (k == "decay" and v is None)},
                 **(q.get(qtype) or {} if qtype in ("vqp", "simvq", "lfq") else {}))
    if qtype == "fsq" and q.get("fsq_levels") is not None:
        new_q["levels"] = q["fsq_levels"]
    return {**raw, "quantizer": new_q, "model": {**model, **{k: v for k, v in m.items() if k in model}}}


def check_saved_keys(raw: Any, where: str = "the run's config") -> Any:
    """A run's saved config (a 0.2.0 one migrated); ConfigError unless it has exactly this version's keys (an older
    run's would be misread): the dataclass sections' and those of its model.arch and quantizer.type."""
    if not isinstance(raw, dict):
        return raw  # apply() says what is wrong with it
    check_not_prior(raw, where)
    raw = migrate_0_2_0(raw)
    given, valid = set(), {k for k in all_keys() if k.split(".")[0] not in ("model", "quantizer")}
    for section, values in raw.items():
        given |= {f"{section}.{key}" for key in values} if isinstance(values, dict) else {str(section)}
    for section, resolve in (("model", resolve_model), ("quantizer", resolve_quantizer)):
        part = raw.get(section) if isinstance(raw.get(section), dict) else {}
        try:  # the keys of its arch / type (a peer's keywords as given)
            keys = resolve({k: part[k] for k in ("arch", "type") if k in part})
        except ConfigError:
            return raw  # resolving it says what is wrong
        peer = constructor_keys(QUANTIZER_TYPES[keys["type"]])[1] if section == "quantizer" else []
        valid |= {f"{section}.{k}" for k in keys} | {f"{section}.{k}" for k in part if peer is None or k in peer}
    gone, new = sorted(given - valid), sorted(valid - given)
    if gone or new:
        what = (f"{', '.join(gone[:4])}{' ...' if len(gone) > 4 else ''} {'was' if len(gone) == 1 else 'were'} retired "
                "or renamed" if gone else f"{', '.join(new[:4])}{' ...' if len(new) > 4 else ''} existed")
        raise ConfigError(f"{where} was written by ddcl-vq {OLD_VERSION} before {what}; evaluate it with ddcl-vq "
                          "0.1.x or retrain it with this version")
    return raw


def validate(cfg: Config) -> None:
    check_finite(cfg)
    check(cfg, RULES)
    check_photos(cfg.data.train_photos, cfg.data.test_photos)
    m, lc, size = cfg.model, cfg.loss, cfg.data.image_size
    if m["arch"] == "vqgan":  # the image size a multiple of 2**(len(ch_mult) - 1), channels divisible by the groups
        ch, ch_mult, groups = m["ch"], m["ch_mult"], m["norm_groups"]
        if not ch_mult:
            raise ConfigError("config key 'model.ch_mult': expected at least one multiplier, got []")
        factor = 2 ** (len(ch_mult) - 1)
        if size % factor:
            raise ConfigError(f"config key 'data.image_size': expected a multiple of {factor} (the VQGAN encoder "
                              f"halves the image len(model.ch_mult) - 1 = {len(ch_mult) - 1} times), got {size}")
        bad = [ch * k for k in ch_mult if (ch * k) % groups]
        if bad:
            raise ConfigError(f"config key 'model.norm_groups': expected every block width model.ch x model.ch_mult "
                              f"to be a multiple of {groups} (GroupNorm), got widths {bad}")
    elif size % 2 ** m["num_downsamples"]:
        halvings, factor = m["num_downsamples"], 2 ** m["num_downsamples"]
        lower, upper = size // factor * factor, (size // factor + 1) * factor
        most = (size & -size).bit_length() - 1  # how often size itself can be halved
        hint = (f"e.g. {lower} or {upper}" if lower else
                f"e.g. {upper}, or model.num_downsamples={most} or fewer for {size}-pixel images")
        raise ConfigError(f"config key 'data.image_size': expected a multiple of {factor} (the model halves the "
                          f"image model.num_downsamples={halvings} times), got {size}; {hint}")
    if lc.disc_lr is not None and not lc.disc_lr > 0:
        raise ConfigError(f"config key 'loss.disc_lr': expected a value > 0 (or null for train.lr), got {lc.disc_lr!r}")
    if lc.disc_weight > 0 and size < 3 * 2 ** lc.disc_layers:
        raise ConfigError(f"config key 'loss.disc_layers': a {lc.disc_layers}-layer PatchGAN needs images of at "
                          f"least {3 * 2 ** lc.disc_layers}px, got data.image_size={size}; lower loss.disc_layers")
    if cfg.data.augment != "none" and cfg.data.name != "image_folder":
        raise ConfigError(f"config key 'data.augment': {cfg.data.augment!r} is for data.name image_folder, got "
                          f"{cfg.data.name!r}; use data.augment=none")
    check_quantizer(cfg.quantizer, m["latent_dim"], cfg.train.steps)


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
    if m["arch"] == "vqgan":
        levels = [cfg.data.image_size // 2 ** i for i in range(len(m["ch_mult"]))]
        missing = [r for r in m["attn_resolutions"] if r not in levels]
        if missing:
            raise ConfigError(f"config key 'model.attn_resolutions': {missing} match no level of the VQGAN (its "
                              f"blocks work at {levels} pixels for data.image_size={cfg.data.image_size} and "
                              f"model.ch_mult={m['ch_mult']}), so no attention would be added there; list some "
                              "of those, or [] for attention only in the middle block")


def _unknown_key(key: str) -> ConfigError:
    moved = [text for old, text in MOVED.items() if key.startswith(old + ".")]
    return ConfigError(f"unknown config key {key!r}; {moved[0] if moved else did_you_mean(key, all_keys())}")


def apply_overrides(raw: Dict[str, Any], overrides: Sequence[str]) -> Dict[str, Any]:
    """A copy of ``raw`` with every training-config override set (model.* and quantizer.* are checked against the
    constructors when the config is resolved)."""
    return _apply_overrides(raw, overrides, all_keys(), _unknown_key, ("model", "quantizer"))


def load_config(path: Optional[str | Path] = None, overrides: Sequence[str] = (), *, saved: bool = False) -> Config:
    """YAML file (optional; a run config of 0.2.0 migrated) + dotted overrides -> validated Config (``saved``:
    :meth:`Config.from_dict`)."""
    raw: Dict[str, Any] = read_yaml_mapping(Path(path), "config file") if path is not None else {}
    check_not_prior(raw, f"config file {str(path)!r}")
    raw = check_saved_keys(raw, f"config file {str(path)!r}") if saved else migrate_0_2_0(raw)
    return Config.resolved(apply_overrides(raw, overrides), training=not saved)


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
            schedule = cfg.quantizer.get("temperature_schedule", "constant")
            stretched = [what for what, on in (("the learning-rate schedule", cfg.train.lr_schedule != "constant"),
                                               ("the temperature schedule", schedule != "constant")) if on]
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


# ----------------------------------------------------------------------------- config -> model, optimizer, schedule
def model_config(cfg: Config, in_channels: int) -> Dict[str, Any]:
    """``VQVAE.from_config``'s config (what an export's config.json holds): the ``model`` and ``quantizer`` sections,
    with the data's channels (and image size: a VQGAN's resolution) and train.steps (a temperature schedule's)."""
    vqgan = {"resolution": cfg.data.image_size} if cfg.model["arch"] == "vqgan" else {}
    return {"format": CONFIG_FORMAT, "model": {**cfg.model, "in_channels": in_channels, **vqgan},
            "quantizer": {"type": cfg.quantizer["type"], **quantizer_arguments(cfg.quantizer, cfg.train.steps)}}


def build_model(cfg: Config, in_channels: int) -> VQVAE:
    """``VQVAE.from_config(model_config(cfg, in_channels))``; a setting the quantizer refuses is a ConfigError."""
    config, peer = model_config(cfg, in_channels), hasattr(QUANTIZER_TYPES[cfg.quantizer["type"]], "peer")
    try:  # a peer checks its keyword arguments with TypeError/assert too
        return VQVAE.from_config(config)
    except (ValueError, TypeError, AssertionError) if peer else ValueError as err:
        raise refused("quantizer", list(config["quantizer"]), err, f"the {cfg.quantizer['type']} quantizer") from None


def build_optimizer(model: VQVAE, t: TrainConfig, quantizer_type: str = "") -> torch.optim.Optimizer:
    """AdamW: encoder/decoder at ``lr``, a codebook trained by gradient at ``codebook_lr_ratio``·lr."""
    codebook = [p for p in model.quantizer.parameters() if p.requires_grad]
    ids = {id(p) for p in codebook}
    rest = [p for p in model.parameters() if p.requires_grad and id(p) not in ids]
    groups = [{"params": rest, "lr": t.lr, "weight_decay": t.weight_decay, "name": "encoder_decoder"}]
    if codebook:
        groups.append({"params": codebook, "lr": t.lr * t.codebook_lr_ratio, "weight_decay": 0.0, "name": "codebook"})
    return torch.optim.AdamW(groups, lr=t.lr, betas=(0.9, 0.99))


def lr_lambda(t: TrainConfig):
    """The tokenizer's learning-rate factor: ``train.lr_schedule`` over ``train.steps`` (cosine to 10%, no warm-up)."""
    return lr_schedule(t.steps, t.lr_schedule, warmup=0, floor=0.1)
