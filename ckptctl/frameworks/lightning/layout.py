"""Lightning checkpoints (LAYOUTS.md §5; lightning 2.6.6).

```
DIRPATH/                            ModelCheckpoint's dirpath (default: <default_root_dir>/<logger>/version_N/checkpoints)
    epoch=0-step=100.ckpt           one torch.save zip per save, named by `filename` ('{epoch}-{step}' by default;
    epoch=0-step=200.ckpt             metrics too: 'model-{epoch}-{val_loss:.2f}' -> model-epoch=0-val_loss=0.42.ckpt)
    last.ckpt                       save_last=True: a copy of the newest; save_last="link": a symbolic link to it
    epoch=0-step=300.ckpt/          FSDPStrategy(state_dict_type="sharded"): a folder, torch DCP of
        .metadata, __R_0.distcp       {"model": state_dict, "optimizer_0": ...}, then meta.pt (the rest, torch.save)
        meta.pt                       written by rank 0 after the DCP save (`_is_sharded_checkpoint` = folder + meta.pt)
    epoch=0-step=400.ckpt/          DeepSpeedStrategy: a DeepSpeed save folder, tag `checkpoint`
        checkpoint/                   mp_rank_00_model_states.pt (the module's weights + Lightning's dict as
                                      client state), *_optim_states.pt (ZeRO partitions)
        latest                        "checkpoint", written after the tag; zero_to_fp32.py, DeepSpeed's script
```

A DeepSpeed folder (lightning 2.6.6 `pytorch/strategies/deepspeed.py` `DeepSpeedStrategy.save_checkpoint`):
`deepspeed_engine.save_checkpoint(filepath, client_state=<the checkpoint dict without state_dict and
optimizer_states>, tag="checkpoint")`; the weights are the LightningModule's own state dict (no `state_dict.`
key in front), the optimizer its ZeRO partitions. It is read with `families.zero_tag`.

A file is written at once (`_atomic_save`: a BytesIO, then an fsspec transaction), so it is complete when
listed. Its keys (`checkpoint_connector.py` `dump_checkpoint`): `epoch`, `global_step`,
`pytorch-lightning_version`, `state_dict` (the LightningModule's: its submodules' names in front of the
model's own, `model.`), `loops`, `callbacks` (each callback's state by its `state_key`: ModelCheckpoint's
`best_model_path`, `best_k_models`, ...), `optimizer_states`, `lr_schedulers`, `hparams_name`,
`hyper_parameters`. Everything is read through the allowlisting unpickler (`formats.torch_pickle`): tensors
as facts, `hyper_parameters` values of the classes Lightning itself writes as stand-ins
(`frameworks.lightning.pickle_classes`), anything else refused.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from functools import cache, partial
from typing import TYPE_CHECKING, Any

from ckptctl import io
from ckptctl.checkpoint import (
    Checkpoint,
    CheckpointRef,
    CheckpointState,
    Component,
    Problem,
    ProblemKind,
    TensorEntry,
)
from ckptctl.contract.base import (
    Layout,
    Protections,
    default_torch_archives,
    every_child_folder,
    folder_size,
    list_files,
    newest_mtime,
    timestamp,
)
from ckptctl.errors import CkptctlError, UnknownLayout, UnsafePickle, UnsupportedClass
from ckptctl.families.dcp_folder import DISTCP_RE, dcp_tensor_index, verify_dcp, world_size_of
from ckptctl.families.hf_folder import torch_file_entries
from ckptctl.families.torch_file import torch_file_problems
from ckptctl.families.zero_tag.names import LATEST_NAME, TagFiles, missing_note, read_latest, tag_files
from ckptctl.families.zero_tag.tag import ENGINE_KEYS, missing_rank_files, read_tag
from ckptctl.families.zero_tag.tensor_index import tag_index
from ckptctl.families.zero_tag.verify import verify_tag
from ckptctl.formats.dcp_metadata import METADATA_NAME
from ckptctl.formats.documents import as_real, as_whole
from ckptctl.formats.safe_pickle import FrameworkObject, StandIn, state_fields
from ckptctl.formats.torch_pickle import TorchPickle, open_torch_pickle
from ckptctl.formats.torch_pickle_classes import TensorRef
from ckptctl.formats.torch_zip import TorchArchive
from ckptctl.frameworks.lightning.files import DEEPSPEED_TAG, LAST, META, SUFFIX
from ckptctl.io import DirEntry
from ckptctl.layouts import peek_dir

if TYPE_CHECKING:
    from ckptctl.contract.resume import ResumeProfile

__all__ = ["LightningLayout", "lightning_dict_file", "name_fields", "open_lightning_file"]

_LAST = re.compile(r"^last(?:-v\d+)?\.ckpt$")
#: `key=value` parts of a ModelCheckpoint file name (`epoch=3-step=1200-val_loss=0.42`).
_FIELD = re.compile(r"(?:^|[-_ ])([A-Za-z_][\w/.]*?)=(-?\d+(?:\.\d+)?(?:[eE][-+]?\d+)?)(?=$|[-_ ])")
#: What the state dict's own file is, by top-level key: component of its tensors.
_COMPONENTS = {
    "state_dict": Component.MODEL,
    "optimizer_states": Component.OPTIMIZER,
    "lr_schedulers": Component.SCHEDULER,
}
#: Hyperparameter values shown by `inspect` are cut to this many characters.
_SHOWN = 200
#: Said of a refused class: Lightning pickles whatever the module's hyperparameters hold.
_UNSAFE = (
    "; a Lightning checkpoint pickles the module's hyper_parameters as given, and ckptctl reads only the classes "
    "Lightning itself writes there (AttributeDict, argparse.Namespace, OmegaConf containers)"
)
_UNSAFE_HINT = "a class of the training code (or a crafted payload) is in the file: nothing of it was executed"


def name_fields(name: str) -> dict[str, float | int]:
    """The `key=value` fields of a checkpoint file name (`epoch=0-step=200-val_loss=0.42.ckpt`), numbers."""
    stem = name.removesuffix(SUFFIX)
    found: dict[str, float | int] = {}
    for key, value in _FIELD.findall(stem):
        number = json.loads(value) if re.fullmatch(r"-?\d+(?:\.\d+)?(?:[eE][-+]?\d+)?", value) else None
        if isinstance(number, int | float):
            found.setdefault(key, number)
    return found


class LightningLayout(Layout):
    """Lightning `ModelCheckpoint` files and sharded FSDP `.ckpt` folders."""

    name = "lightning"
    checkpoint_files = (SUFFIX,)

    # ------------------------------------------------------------------------------------ the files

    def identify_file(self, url: str, entry: DirEntry) -> CheckpointRef | None:
        """A `.ckpt` file: step and epoch from its name; `last.ckpt` (whose name says neither) from its pickle.
        A `last.ckpt` that is a symbolic link is a pointer (`latest_pointer`), not a checkpoint of its own."""
        name = entry.name
        if not name.endswith(SUFFIX) or (_LAST.match(name) and io.is_link(url)):
            return None
        fields = name_fields(name)
        step, epoch = as_whole(fields.get("step")), as_real(fields.get("epoch"))
        state, note = CheckpointState.COMPLETE, ""
        if _LAST.match(name) and step is None:
            try:
                root = open_lightning_file(url, entry.size).root
            except CkptctlError as exc:
                state, note = CheckpointState.BROKEN, exc.message
            else:
                counters = _counters(root)
                step, epoch = counters.get("global_step"), counters.get("epoch")
        return CheckpointRef(
            url=url,
            layout=self.name,
            step=step,
            epoch=epoch,
            created=timestamp(entry.mtime),
            state=state,
            size_bytes=entry.size,
            note=note,
        )

    # ----------------------------------------------------------------------------- sharded folders

    def identify(self, url: str, entries: Sequence[DirEntry]) -> CheckpointRef | None:
        """A sharded FSDP checkpoint: a folder named `*.ckpt` holding a DCP save (and `meta.pt` once done);
        or a DeepSpeed one: a `*.ckpt` folder holding the tag `checkpoint/` (and `latest` once done)."""
        if not io.name_of(url).endswith(SUFFIX):
            return None
        names = {e.name for e in entries if not e.is_dir}
        if any(e.is_dir and e.name == DEEPSPEED_TAG for e in entries):
            return self._identify_deepspeed(url, entries)
        if not (names & {METADATA_NAME, META} or any(DISTCP_RE.match(n) for n in names)):
            return None
        if META in names and METADATA_NAME in names:
            state, note = CheckpointState.COMPLETE, ""
        else:
            state = CheckpointState.IN_PROGRESS
            note = (
                f"no {META if METADATA_NAME in names else METADATA_NAME} yet: rank 0 writes {META} after the DCP save"
            )
        return self._folder_ref(url, entries, META, state, note, sum(e.size for e in entries if not e.is_dir))

    def _identify_deepspeed(self, url: str, entries: Sequence[DirEntry]) -> CheckpointRef | None:
        """A DeepSpeed `.ckpt` folder: complete once `latest` names its tag (DeepSpeed writes it after the rank
        files), broken when the tag lacks a rank file."""
        tag = tag_files(peek_dir(io.join(url, DEEPSPEED_TAG)) or [])
        if tag is None:
            return None
        state, note = CheckpointState.COMPLETE, ""
        if read_latest(url, entries) != DEEPSPEED_TAG:
            state = CheckpointState.IN_PROGRESS
            note = f"no {LATEST_NAME} naming {DEEPSPEED_TAG}/ yet: DeepSpeed writes it after the rank files"
        elif missing := missing_rank_files(io.join(url, DEEPSPEED_TAG), tag):
            state, note = CheckpointState.BROKEN, f"{DEEPSPEED_TAG}/: {missing_note(missing)}"
        return self._folder_ref(url, entries, LATEST_NAME, state, note, folder_size(url, entries))

    def _folder_ref(
        self, url: str, entries: Sequence[DirEntry], marker_name: str, state: CheckpointState, note: str, size: int
    ) -> CheckpointRef:
        """A `.ckpt` folder's ref: step and epoch from its name, dated by the file written last (`marker_name`)."""
        fields = name_fields(io.name_of(url))
        marker = next((e for e in entries if e.name == marker_name and not e.is_dir), None)
        return CheckpointRef(
            url=url,
            layout=self.name,
            step=as_whole(fields.get("step")),
            epoch=as_real(fields.get("epoch")),
            created=timestamp(marker.mtime if marker is not None else newest_mtime(entries)),
            state=state,
            size_bytes=size,
            note=note,
        )

    def members(self, url: str, entries: Sequence[DirEntry]) -> frozenset[str]:
        """A DeepSpeed `.ckpt` folder's tag: one save wrote it, and it is no checkpoint of its own."""
        return every_child_folder(entries) if io.name_of(url).endswith(SUFFIX) else frozenset()

    def latest_pointer(self, url: str, entries: Sequence[DirEntry]) -> str | None:
        """`last.ckpt`: the file itself (a copy), or the checkpoint of this folder its symbolic link names."""
        last = next((e for e in entries if e.name == LAST), None)
        if last is None:
            return None
        path = io.join(url, LAST)
        if not io.is_link(path):
            return LAST
        target = os.path.realpath(io.local_path(path))
        here = os.path.realpath(io.local_path(url))
        return os.path.basename(target) if os.path.dirname(target) == here else None

    # ------------------------------------------------------------------------------------ reading

    def open(self, url: str) -> Checkpoint:
        """The file's pickle (`data.pkl` only) or the folder's `.metadata` and `meta.pt`: counters, callbacks,
        hyperparameters; a lazy tensor index (state_dict, optimizer states)."""
        if io.is_dir(url):
            if io.is_dir(io.join(url, DEEPSPEED_TAG)):
                return self._open_deepspeed(url)
            return self._open_sharded(url)
        name = io.name_of(url)
        entry = next((e for e in io.list_dir(io.parent_of(url)) if e.name == name and not e.is_dir), None)
        ref = self.identify_file(url, entry) if entry is not None else None
        if ref is None or entry is None:
            raise UnknownLayout(f"{url} is not a Lightning checkpoint file (*.ckpt)")
        opened = open_lightning_file(url, entry.size)
        root = opened.root if isinstance(opened.root, dict) else {}
        counters = _counters(root)
        ref = replace(
            ref,
            step=counters.get("global_step", ref.step),
            epoch=counters.get("epoch", ref.epoch),
        )
        entries = tuple(torch_file_entries(opened, "", _classify))
        components = {e.component for e in entries}
        return self._checkpoint(ref, root, components, lambda: entries, {"": entry.size}, "torch.save zip")

    def _open_sharded(self, url: str) -> Checkpoint:
        entries = io.list_dir(url)
        ref = self.identified(url, entries, f"a sharded Lightning checkpoint (no DCP files, no {META})")
        files = list_files(url)
        root: Mapping[str, Any] = {}
        error = ""
        if META in files:
            try:
                opened = open_lightning_file(io.join(url, META), files[META]).root
                root = opened if isinstance(opened, dict) else {}
            except CkptctlError as exc:
                error = f"{META}: {exc.message}"
        counters = _counters(root)
        ref = replace(ref, step=counters.get("global_step", ref.step), epoch=counters.get("epoch", ref.epoch))

        @cache
        def tensor_index() -> tuple[TensorEntry, ...]:
            return dcp_tensor_index(url, _classify_sharded)

        components = {Component.MODEL}
        if any(name.startswith("optimizer_") for name in _dcp_keys(url)):
            components.add(Component.OPTIMIZER)
        checkpoint = self._checkpoint(ref, root, components, tensor_index, files, "sharded: torch DCP + meta.pt")
        world = world_size_of(entries)
        checkpoint = replace(checkpoint, world_size=world)
        if error:
            checkpoint = replace(checkpoint, metadata={**checkpoint.metadata, "error": error})
        return checkpoint

    def _open_deepspeed(self, url: str) -> Checkpoint:
        ref = self.identified(
            url, io.list_dir(url), f"a Lightning DeepSpeed checkpoint (no DeepSpeed tag {DEEPSPEED_TAG}/)"
        )
        files = list_files(url)
        try:
            tag = read_tag(io.join(url, DEEPSPEED_TAG))
        except CkptctlError as exc:
            return Checkpoint.unreadable(ref, exc, files)
        root = tag.client_state()
        counters = _counters(root)
        ref = replace(ref, step=counters.get("global_step", ref.step), epoch=counters.get("epoch", ref.epoch))

        @cache
        def tensor_index() -> tuple[TensorEntry, ...]:
            return tag_index(tag, f"{DEEPSPEED_TAG}/")

        components = set(tag.components())
        checkpoint = self._checkpoint(ref, root, components, tensor_index, files, "DeepSpeed save folder")
        return replace(
            checkpoint, world_size=tag.world_size, metadata={**checkpoint.metadata, "deepspeed": tag.summary()}
        )

    def _checkpoint(
        self,
        ref: CheckpointRef,
        root: Mapping[str, Any],
        components: set[Component],
        index: Callable[[], tuple[TensorEntry, ...]],
        files: Mapping[str, int],
        kind: str,
    ) -> Checkpoint:
        counters = _counters(root)
        metadata: dict[str, Any] = {"format": f"Lightning checkpoint ({kind})"}
        version = root.get("pytorch-lightning_version")
        if isinstance(version, str):
            metadata["lightning_version"] = version
        if counters:
            metadata["progress"] = counters
        if root.get("lr_schedulers"):
            components.add(Component.SCHEDULER)
        if root.get("optimizer_states"):
            components.add(Component.OPTIMIZER)
        if "loops" in root or counters:
            components.add(Component.TRAINER_STATE)
        if root.get("callbacks") or root.get("hyper_parameters"):
            components.add(Component.EXTRA)
        callbacks = root.get("callbacks")
        if isinstance(callbacks, dict) and callbacks:
            metadata["callbacks"] = sorted(str(k).partition("{")[0] for k in callbacks)
            best = _best_model_path(callbacks, io.parent_of(ref.url))
            if best:
                metadata["best_model_path"] = best
        hparams = root.get("hyper_parameters")
        if isinstance(hparams, dict | StandIn) and hparams:
            metadata["hyper_parameters"] = _summary(hparams)
        optimizers = root.get("optimizer_states")
        if isinstance(optimizers, list):
            metadata["optimizers"] = len(optimizers)
        metrics = {k: v for k, v in name_fields(io.name_of(ref.url)).items() if k not in ("epoch", "step")}
        if metrics:
            metadata["metrics"] = metrics
        return Checkpoint(
            ref=ref,
            components=frozenset(components),
            world_size=None,
            metadata=metadata,
            tensor_index=index,
            files=files,
            metrics=metrics,
            progress=counters,
        )

    def torch_archives(self, checkpoint: Checkpoint) -> Sequence[TorchArchive]:
        """A `.ckpt` file is itself a torch.save zip; a folder's are found by name (its DCP items and `meta.pt`, or
        the `*_states.pt` of a DeepSpeed save)."""
        if "" in checkpoint.files:
            return (TorchArchive(""),)
        return default_torch_archives(checkpoint)

    def verify(self, checkpoint: Checkpoint) -> list[Problem]:
        """A file: its zip and pickle read with the allowlist, every storage lies whole inside it, and it holds
        what `dump_checkpoint` writes (`state_dict`, `global_step`, `epoch`). A sharded folder: the DCP rules
        (`verify_dcp`), and `meta.pt` present (written last) and readable."""
        url = checkpoint.url
        if io.is_dir(io.join(url, DEEPSPEED_TAG)):
            return self._verify_deepspeed(url)
        if io.is_dir(url):
            return self._verify_sharded(url)
        opened, problems = torch_file_problems("", partial(open_lightning_file, url, checkpoint.ref.size_bytes))
        if opened is None:
            return problems
        return problems + _content_problems(opened.root, "", require_state_dict=True)

    def _verify_deepspeed(self, url: str) -> list[Problem]:
        """The tag's rules (`verify_tag`), `latest` naming it, and Lightning's dict in its client state."""
        problems = verify_tag(io.join(url, DEEPSPEED_TAG), f"{DEEPSPEED_TAG}/")
        if read_latest(url, io.list_dir(url)) != DEEPSPEED_TAG:
            problems.append(
                Problem(
                    ProblemKind.IN_PROGRESS,
                    LATEST_NAME,
                    f"no {LATEST_NAME} naming {DEEPSPEED_TAG}/: DeepSpeed writes it after the rank files, "
                    "so the save has not finished",
                )
            )
        if any(p.severity == "error" for p in problems):
            return problems
        path = lightning_dict_file(url)
        try:
            opened = open_lightning_file(io.join(url, path), None)
        except CkptctlError as exc:
            return [*problems, Problem.from_error(exc, path)]
        client = {k: v for k, v in opened.root.items() if k not in ENGINE_KEYS}
        return problems + _content_problems(client, path, require_state_dict=False)

    def _verify_sharded(self, url: str) -> list[Problem]:
        problems = verify_dcp(url)
        files = {e.name for e in io.list_dir(url) if not e.is_dir}
        if META not in files:
            problems.append(
                Problem(
                    ProblemKind.IN_PROGRESS,
                    META,
                    f"no {META}: rank 0 writes it after the DCP save, so the save has not finished (a resume fails)",
                )
            )
            return problems
        opened, found = torch_file_problems(META, partial(open_lightning_file, io.join(url, META), None))
        if opened is None:
            return problems + found
        return problems + found + _content_problems(opened.root, META, require_state_dict=False)

    def completion_markers(self, files: Mapping[str, int]) -> tuple[str, ...]:
        """A sharded folder's `.metadata` (DCP writes it after the data) and `meta.pt` (Lightning's, last); a
        DeepSpeed folder's `latest` (written after the tag)."""
        names = (METADATA_NAME, META, LATEST_NAME)
        return tuple(name for name in names if name in files)

    def protections(self, series: Sequence[CheckpointRef]) -> Protections:
        """`last.ckpt` (what `ckpt_path="last"` resumes from) and the `best_model_path` that ModelCheckpoint's
        state in the newest checkpoint names (`trainer.test(ckpt_path="best")` loads it)."""
        mine = [ref for ref in series if ref.layout == self.name]
        if not mine:
            return Protections()
        reasons: dict[str, tuple[str, ...]] = {}
        for ref in mine:
            if _LAST.match(io.name_of(ref.url)):
                reasons[ref.url] = ('Lightning\'s last.ckpt (Trainer.fit(ckpt_path="last") resumes from it)',)
        complete = [r for r in mine if r.state is CheckpointState.COMPLETE and r.step is not None]
        if not complete:
            return Protections(reasons)
        newest = max(complete, key=lambda r: (r.step or 0, bool(_LAST.match(io.name_of(r.url)))))
        try:
            root = (
                open_lightning_file(newest.url, None).root
                if not io.is_dir(newest.url)
                else open_lightning_file(io.join(newest.url, lightning_dict_file(newest.url)), None).root
            )
        except CkptctlError:
            return Protections(reasons)
        callbacks = root.get("callbacks") if isinstance(root, dict) else None
        best = _best_model_path(callbacks, io.parent_of(newest.url)) if isinstance(callbacks, dict) else None
        notes: tuple[str, ...] = ()
        if best:
            name = os.path.basename(best.rstrip("/"))
            named = [ref.url for ref in mine if io.name_of(ref.url) == name]
            for url in named:
                reasons[url] = (*reasons.get(url, ()), "Lightning's best_model_path (ModelCheckpoint)")
            if not named:
                notes = (f"ModelCheckpoint's best_model_path {name!r} is not in {io.parent_of(newest.url)}",)
        return Protections(reasons, notes)

    def resume_profile(self) -> ResumeProfile:
        """See `frameworks.lightning.resume`."""
        from ckptctl.frameworks.lightning.resume import PROFILE

        return PROFILE


# --------------------------------------------------------------------------------------------------


def open_lightning_file(url: str, size: int | None) -> TorchPickle:
    """The torch.save file at `url` opened through the allowlist (zip directory and `data.pkl` only).

    Raises:
        UnsafePickle: a class Lightning does not write itself (said so, with what to do).
        CorruptCheckpoint: not a torch.save zip, truncated, or a damaged pickle.
    """
    try:
        return open_torch_pickle(url, size)
    except UnsafePickle as exc:
        raise UnsafePickle(exc.message + _UNSAFE, _UNSAFE_HINT) from exc
    except UnsupportedClass as exc:
        raise UnsupportedClass(exc.message + _UNSAFE, _UNSAFE_HINT) from exc


def lightning_dict_file(folder: str) -> str:
    """The file of a `.ckpt` folder that holds Lightning's checkpoint dict (counters, callbacks,
    hyperparameters): a DeepSpeed folder's rank-0 model states (its client state), else `meta.pt`."""
    tag = io.join(folder, DEEPSPEED_TAG)
    if io.is_dir(tag):
        files = tag_files(io.list_dir(tag))
        rank0 = files.rank0_model() if files is not None else None
        return f"{DEEPSPEED_TAG}/{rank0 or TagFiles.model_name_0(0)}"
    return META


def _counters(root: Any) -> dict[str, Any]:
    """`global_step` and `epoch` as the checkpoint records them."""
    if not isinstance(root, dict):
        return {}
    found: dict[str, Any] = {}
    step, epoch = as_whole(root.get("global_step")), as_whole(root.get("epoch"))
    if step is not None:
        found["global_step"] = step
    if epoch is not None:
        found["epoch"] = epoch
    return found


def _classify(path: str) -> Component:
    return _COMPONENTS.get(path.partition(".")[0], Component.EXTRA)


def _classify_sharded(key: str) -> Component:
    head = key.partition(".")[0]
    if head == "model":
        return Component.MODEL
    return Component.OPTIMIZER if head.startswith("optimizer_") else Component.EXTRA


def _dcp_keys(url: str) -> list[str]:
    from ckptctl.formats.dcp_folder_metadata import load_dcp_metadata

    try:
        return list(load_dcp_metadata(url).entries)
    except CkptctlError:
        return []


def _best_model_path(callbacks: Mapping[Any, Any], folder: str) -> str | None:
    """The `best_model_path` of the ModelCheckpoint among a checkpoint's callbacks that saves into `folder`
    (its `dirpath`; a Trainer may run several, each into its own folder), or of the only one there is."""
    states = [s for k, s in callbacks.items() if str(k).startswith("ModelCheckpoint") and isinstance(s, dict)]
    # Lightning records OS paths: a local folder compares as one, a URL by its text.
    here = os.path.normpath(io.local_path(folder)) if io.is_local(folder) else folder.rstrip("/")
    for state in states:
        best, dirpath = state.get("best_model_path"), state.get("dirpath")
        if not isinstance(best, str) or not best:
            continue
        places = {os.path.normpath(p) for p in (dirpath, os.path.dirname(best)) if isinstance(p, str) and p}
        if here in places or len(states) == 1 or os.path.basename(here) in {os.path.basename(p) for p in places}:
            return best
    return None


def _summary(hparams: Any) -> dict[str, Any]:
    """The hyperparameters for people: scalars as they are, containers and objects named and cut short."""
    fields = state_fields(hparams, "hyper_parameters") if isinstance(hparams, StandIn) else hparams
    shown: dict[str, Any] = {}
    for key, value in list(fields.items())[:50]:
        if isinstance(value, FrameworkObject) and value.value is not None:
            value = value.value
        if isinstance(value, bool | int | float | str) or value is None:
            shown[str(key)] = value if not isinstance(value, str) else value[:_SHOWN]
        elif isinstance(value, dict):
            shown[str(key)] = f"<dict of {len(value)}>"
        elif isinstance(value, TensorRef):
            shown[str(key)] = f"<tensor {value.dtype}{list(value.shape)}>"
        else:
            shown[str(key)] = f"<{getattr(value, 'stands_for', type(value).__name__)}>"
    return shown


def _content_problems(root: Any, path: str, *, require_state_dict: bool) -> list[Problem]:
    """What `dump_checkpoint` always writes and the file lacks."""
    where = path or "the file"
    if not isinstance(root, dict):
        return [
            Problem(ProblemKind.BAD_METADATA, path, f"{where} holds a {type(root).__name__}, not a checkpoint dict")
        ]
    problems = []
    if require_state_dict and not isinstance(root.get("state_dict"), dict):
        problems.append(Problem(ProblemKind.BAD_METADATA, path, f"{where} has no state_dict"))
    for key in ("global_step", "epoch"):
        if as_whole(root.get(key)) is None:
            problems.append(Problem(ProblemKind.BAD_METADATA, path, f"{where} has no {key} (Lightning writes one)"))
    if not isinstance(root.get("pytorch-lightning_version"), str):
        problems.append(
            Problem(
                ProblemKind.BAD_METADATA,
                path,
                f"{where} has no pytorch-lightning_version: not written by Trainer.save_checkpoint",
                severity="warning",
            )
        )
    return problems
