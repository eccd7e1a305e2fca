"""Fixtures shared across the suite: real Hugging Face folders, the demo runs, and a CLI runner.

Slow writers (the demo's 2-rank run, DeepSpeed, the Trainer) are session-scoped and built with
`build_once`: written once per machine into a cache kept between runs (`tests.writer_cache`: keyed by the
writer's code and the frameworks' versions), also when pytest-xdist runs the suite on several workers, and
read by many tests. Tests that modify a checkpoint copy it first (`copy_tree`). Every test that uses one of
`SLOW_FIXTURES` is marked `slow`, so that `make test-fast` (`-m "not slow"`) starts none of them.
"""

from __future__ import annotations

import json
import os
import pickle
import shutil
import tempfile
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import pytest
from filelock import FileLock

from tests import writer_cache
from tests.writers import openrlhf_writer
from tests.writers.accelerate_writer import WrittenAccelerate, write_accelerate_runs
from tests.writers.areal_critic_writer import WrittenArealCritic, write_areal_critic
from tests.writers.areal_writer import WrittenAreal, write_areal_run
from tests.writers.dcp_writer import WrittenDcp, write_single_process_dcp
from tests.writers.deepspeed_wrappers_writer import WrittenWrapperRuns, write_wrapper_runs
from tests.writers.deepspeed_writer import CONVERTER_RUNS, DeepSpeedRuns, WrittenDeepSpeed, write_deepspeed_sets
from tests.writers.hf_legacy_writer import WrittenLegacy, write_legacy_models
from tests.writers.lightning_writer import WrittenLightning, write_lightning_run
from tests.writers.megatron_writer import WrittenMegatron, write_megatron_runs
from tests.writers.models import tiny_llama
from tests.writers.openrlhf_writer import WrittenOpenRlhf
from tests.writers.peft_writer import WrittenPeft, write_peft_adapters
from tests.writers.rl_runs import WrittenFsdpRuns, write_fsdp_runs
from tests.writers.run_folders import NestedRun, arrange_deepspeed_run, trainer_nested_run, write_dcp_run
from tests.writers.torchtitan_writer import WrittenTorchtitan, write_torchtitan_run
from tests.writers.trainer_writer import WrittenTrainerRun, write_trainer_run
from tests.writers.universal_writer import WrittenUniversal, write_universal_runs
from tests.writers.verl_critic_writer import WrittenVerlCritic, write_verl_critic
from tests.writers.verl_writer import WrittenVerl, write_verl_run

if TYPE_CHECKING:
    from ckptctl.contract.base import Layout
    from ckptctl.formats.torch_zip import ZipMember

T = TypeVar("T")

#: Fixtures that start processes or write large checkpoints (tens of seconds each on a small machine).
SLOW_FIXTURES = frozenset(
    {
        "demo_dir",
        "deepspeed_writers",
        "deepspeed_runs",
        "deepspeed_universal",
        "trainer_run",
        "zero_runs",
        "llama_dcp",
        "fsdp_dcp",
        "fsdp_runs",
        "areal_run",
        "areal_critic",
        "verl_run",
        "bytecheckpoint_run",
        "verl_critic",
        "fsdp_run",
        "big_dcp",
        "interrupted_saves",
        "openrlhf_ppo",
        "megatron_runs",
        "accelerate_runs",
        "deepspeed_wrappers",
        "distributed_saves",
        "torchtitan_run",
        "peft_adapters",
        "lightning_run",
    }
)


#: Session fixtures that cannot be cached (`interrupted_saves` leaves a live writer process behind): the tests
#: using one run on one xdist worker (`make test` distributes with `--dist loadgroup`), so it is built once.
PER_RUN_FIXTURES = frozenset({"interrupted_saves"})


@pytest.hookimpl(wrapper=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> Iterator[None]:
    for item in items:
        fixtures = set(getattr(item, "fixturenames", ()))
        if SLOW_FIXTURES & fixtures:
            item.add_marker(pytest.mark.slow)
        for name in sorted(PER_RUN_FIXTURES & fixtures):
            item.add_marker(pytest.mark.xdist_group(name))
    # The longest tests first: `--dist loadgroup` hands tests out one at a time in this order, so a worker that
    # drew one early is not the last to finish while the other waits (the 20 kill trials of sync alone ran
    # 35 s after the other worker had finished when collection order put them near the end).
    items.sort(key=lambda item: item.get_closest_marker("long") is None)
    yield
    _group_for_xdist(config, items)


def _group_for_xdist(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Give each item marked `xdist_group(NAME)` the node id `ID@NAME` that `--dist loadgroup` schedules by.

    pytest-xdist's worker does this in a hook of its own by setting `item._nodeid`, which pytest 9 no longer
    reads (a node's id is `item._id`): without this every group was spread over the workers, and each worker
    built `interrupted_saves` for itself (~10 s of CPU each)."""
    if not config.getoption("loadgroup", False):  # set on xdist workers under --dist loadgroup
        return
    try:
        from _pytest.nodeid import NodeId
    except ImportError:  # an older pytest, where xdist's own hook works
        return
    for item in items:
        marks = item.iter_markers("xdist_group")
        groups = sorted({str(m.args[0] if m.args else m.kwargs.get("name", "default")) for m in marks})
        if groups and "@" not in item.nodeid and hasattr(item, "_id"):
            grouped = f"{item.nodeid}@{'_'.join(groups)}"
            item._id = NodeId.parse(grouped)
            assert item.nodeid == grouped, (item.nodeid, grouped)


def build_once(tmp_path_factory: pytest.TempPathFactory, name: str, build: Callable[[Path], T]) -> T:
    """`build(folder)` for a session fixture, run once per machine while the writer's code and the frameworks
    stay the same, and read by every test run after (`tests.writer_cache`: its cache folder, key and rules).

    The cached folder is shared: tests only read it, and copy what they change (`copy_tree`; a test that
    writes into it fails the session). Its files are dated as if written at the start of the run.

    Under pytest-xdist every worker runs session fixtures of its own: the first worker to ask fetches the
    entry (building it if no run has) under a file lock into a folder all workers of the run share, and
    records what it got; the others wait for it and read that record. Without xdist it is a plain `mktemp`.
    """
    entry = writer_cache.entry_for(name, build)
    if entry is None:  # CKPTCTL_TEST_CACHE=off, or a build closing over a value pickle cannot write
        return _once_per_run(tmp_path_factory, name, lambda folder: _build_retrying(build, folder))

    return _once_per_run(tmp_path_factory, name, lambda _: entry.get(lambda out: _build_retrying(build, out)))


def _once_per_run(tmp_path_factory: pytest.TempPathFactory, name: str, build: Callable[[Path], T]) -> T:
    """`build(folder)` once per test run whatever the number of xdist workers (see `build_once`)."""
    if os.environ.get("PYTEST_XDIST_WORKER") is None:
        return build(tmp_path_factory.mktemp(name))
    shared = tmp_path_factory.getbasetemp().parent / "shared"  # the run's folder, above each worker's own
    shared.mkdir(exist_ok=True)
    record = shared / f"{name}.pickle"
    failure = shared / f"{name}.failed"
    with FileLock(str(shared / f"{name}.lock")):
        if record.exists():
            built: T = pickle.loads(record.read_bytes())  # written by this run's own fixture code just before
            return built
        if failure.exists():
            # Another worker's build failed: say why here too, rather than building again for minutes (or
            # tripping over its half-written folder).
            pytest.fail(f"the {name!r} fixture failed to build in another worker:\n{failure.read_text()}")
        folder = shared / name
        folder.mkdir()
        try:
            built = build(folder)
        except BaseException as exc:
            failure.write_text(f"{type(exc).__name__}: {exc}")
            raise
        record.write_bytes(pickle.dumps(built))
        return built


@pytest.fixture(scope="session", autouse=True)
def _cached_outputs_unchanged() -> Iterator[None]:
    """Fails the session when one of its tests changed a writer's output in the cache (and drops that entry,
    so that the next run builds it again): tests copy what they change."""
    yield
    changed = writer_cache.changed_entries()
    if changed:
        pytest.fail(
            "tests changed cached writer outputs (copy_tree what a test changes):\n"
            + "\n".join(f"{entry.name} ({entry.out}): {', '.join(files[:8])}" for entry, files in changed.items())
        )


def _build_retrying(build: Callable[[Path], T], folder: Path) -> T:
    """`build(folder)`, once more into an emptied folder when a spawned rank was killed by a signal.

    gloo on a loaded 2-core machine occasionally aborts a rank at process-group start-up or teardown
    (SIGABRT, "terminate called without an active exception"); that says nothing about ckptctl, while a
    rank that raises is a real failure and is not retried.
    """
    import torch.multiprocessing as torch_mp

    try:
        return build(folder)
    except torch_mp.ProcessExitedException as exc:
        if exc.signal_name is None:
            raise
        shutil.rmtree(folder)
        folder.mkdir()
        return build(folder)


os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
# convert's model check keeps the specs it builds in the user's cache (frameworks/hf/spec_cache.py): a test run
# keeps its own, so it neither writes into ~/.cache nor reads back a spec an earlier run left there.
os.environ.setdefault("CKPTCTL_CACHE_DIR", tempfile.mkdtemp(prefix="ckptctl-user-cache-"))


def _hf_models(root: Path) -> dict[str, Path]:
    model = tiny_llama()
    model.save_pretrained(root / "single")
    model.save_pretrained(root / "sharded", max_shard_size="20KB")
    reference = {k: v.detach().clone() for k, v in model.state_dict().items()}
    import torch

    torch.save(reference, root / "reference.pt")
    return {"single": root / "single", "sharded": root / "sharded", "reference": root / "reference.pt"}


@pytest.fixture(scope="session")
def hf_model_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The same tiny Llama saved by transformers `save_pretrained` as one file and as 4+ shards."""
    return build_once(tmp_path_factory, "hf", _hf_models)


@pytest.fixture(scope="session")
def legacy_models(tmp_path_factory: pytest.TempPathFactory) -> WrittenLegacy:
    """`pytorch_model.bin` folders as transformers 4 wrote them (one file; tied and sharded), and the tied
    Llama as transformers 5 saves it (see `tests.writers.hf_legacy_writer`)."""
    return build_once(tmp_path_factory, "hf-legacy", write_legacy_models)


@pytest.fixture(scope="session")
def peft_adapters(tmp_path_factory: pytest.TempPathFactory) -> WrittenPeft:
    """peft 0.21.2's `save_pretrained` of LoRA adapters on the tiny Llama (plain with patterns and an Embedding
    LoRA, rsLoRA, modules_to_save, lora_alpha 0, DoRA), each with PEFT's `merge_and_unload()` state dict, and a
    PEFT-wrapped model saved whole by DCP (see `tests.writers.peft_writer`)."""
    return build_once(tmp_path_factory, "peft", write_peft_adapters)


@pytest.fixture(scope="session")
def lightning_run(tmp_path_factory: pytest.TempPathFactory) -> WrittenLightning:
    """lightning 2.6.6 on 2 CPU ranks (ddp), ModelCheckpoint every 2 of 4 steps: files with last.ckpt as a
    copy and as a link, and a sharded FSDP-style `.ckpt/` folder (see `tests.writers.lightning_writer`; slow:
    spawns)."""
    return build_once(tmp_path_factory, "lightning", lambda root: write_lightning_run(root / "run"))


def _demo(root: Path) -> Path:
    from ckptctl.demo import run_demo

    run_demo(str(root / "demo"), steps=30, distributed=True)
    return root / "demo"


@pytest.fixture(scope="session")
def demo_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """`ckptctl demo` output (single-process native run, 2-rank FSDP2 run, plain DCP, HF export)."""
    return build_once(tmp_path_factory, "demo", _demo)


@dataclass(frozen=True)
class DeepSpeedWriters:
    """What the one DeepSpeed spawn of `deepspeed_writers` wrote: sets of ZeRO runs by name, and OpenRLHF's."""

    runs: dict[str, dict[int, WrittenDeepSpeed]]
    openrlhf: WrittenOpenRlhf


@pytest.fixture(scope="session")
def deepspeed_writers(tmp_path_factory: pytest.TempPathFactory) -> DeepSpeedWriters:
    """The suite's DeepSpeed runs (`deepspeed_runs`), the converter tests' (`CONVERTER_RUNS`) and OpenRLHF's PPO
    saves (`openrlhf_ppo`), written by the same 2 spawned CPU ranks (slow: spawns)."""

    def build(root: Path) -> DeepSpeedWriters:
        sets = {"suite": DeepSpeedRuns(stages=(0, 2, 3)), "converter": CONVERTER_RUNS}
        openrlhf = root / "openrlhf-ppo"
        openrlhf_writer.prepare_run(openrlhf)
        written = write_deepspeed_sets(
            {root / name: runs for name, runs in sets.items()}, then=[(openrlhf_writer.train_rank, (str(openrlhf),))]
        )
        return DeepSpeedWriters({name: written[root / name] for name in sets}, openrlhf_writer.written_run(openrlhf))

    return build_once(tmp_path_factory, "deepspeed", build)


@pytest.fixture(scope="session")
def deepspeed_runs(deepspeed_writers: DeepSpeedWriters) -> dict[int, WrittenDeepSpeed]:
    """DeepSpeed on 2 CPU ranks, bf16, ZeRO 0, 2 and 3, tags global_step2 and global_step4 (slow: spawns)."""
    return deepspeed_writers.runs["suite"]


@pytest.fixture(scope="session")
def deepspeed_universal(
    tmp_path_factory: pytest.TempPathFactory,
    deepspeed_runs: dict[int, WrittenDeepSpeed],
    hf_model_dirs: dict[str, Path],
) -> WrittenUniversal:
    """DeepSpeed's `ds_to_universal` run on copies of the ZeRO-2 and ZeRO-3 save folders and on open-instruct
    and OpenRLHF folders arranged from them, as each framework runs it (slow: a subprocess importing DeepSpeed)."""
    return build_once(
        tmp_path_factory,
        "deepspeed-universal",
        lambda root: write_universal_runs(root, deepspeed_runs, hf_model_dirs["single"]),
    )


@pytest.fixture(scope="session")
def trainer_run(tmp_path_factory: pytest.TempPathFactory) -> WrittenTrainerRun:
    """transformers.Trainer on CPU: checkpoint-2 and checkpoint-4 of the tiny Llama (slow: a subprocess)."""
    return build_once(tmp_path_factory, "trainer", lambda root: write_trainer_run(root / "out"))


@pytest.fixture(scope="session")
def raw_dcp(tmp_path_factory: pytest.TempPathFactory) -> WrittenDcp:
    """A plain single-process `dcp.save` of an unprefixed state dict (many dtypes, views, scalars)."""
    return build_once(tmp_path_factory, "dcp-raw", lambda root: write_single_process_dcp(root / "raw"))


@pytest.fixture(scope="session")
def nested_runs(
    trainer_run: WrittenTrainerRun,
    deepspeed_runs: dict[int, WrittenDeepSpeed],
    tmp_path_factory: pytest.TempPathFactory,
) -> dict[str, NestedRun]:
    """Run folders with a model at their top and checkpoints below it, by the framework of the checkpoints:
    the Trainer's after `save_model()`, a DCP run and a DeepSpeed ZeRO-2 save folder with an exported model
    (see `tests.writers.run_folders`). Tests that change one copy it first."""

    def build(root: Path) -> dict[str, NestedRun]:
        return {
            "hf_trainer": trainer_nested_run(trainer_run),
            "dcp": write_dcp_run(root / "dcp-run"),
            "deepspeed": arrange_deepspeed_run(deepspeed_runs[2], root / "deepspeed-run"),
        }

    return build_once(tmp_path_factory, "nested", build)


@pytest.fixture(scope="session")
def fsdp_runs(tmp_path_factory: pytest.TempPathFactory) -> WrittenFsdpRuns:
    """FSDP2 on 2 CPU ranks, saved every step as AReaL (trial with recover slots, exports, recover_info) and
    ROLL (launch folder with checkpoint-1 and checkpoint-2, the latter with critic/) save (slow: spawns)."""
    return build_once(tmp_path_factory, "fsdp-rl", write_fsdp_runs)


@pytest.fixture(scope="session")
def verl_run(tmp_path_factory: pytest.TempPathFactory) -> WrittenVerl:
    """verl 0.9.1's own FSDPCheckpointManager on 2 CPU ranks (FSDP2): global steps 1 and 2 of a tiny Qwen2 actor
    (1-D fsdp mesh) and critic (HSDP mesh, replicated), the tracker, and verl's own merger's output of step 2
    (slow: spawns)."""
    return build_once(tmp_path_factory, "verl", write_verl_run)


@pytest.fixture(scope="session")
def areal_run(tmp_path_factory: pytest.TempPathFactory) -> WrittenAreal:
    """AReaL's own FSDPLMEngine, Saver and RecoverHandler on one CPU rank, two SFT steps of a tiny Qwen3: a trial
    with the exports of global steps 0 and 1, the recover slot and recover_info/ (slow: spawns)."""
    return build_once(tmp_path_factory, "areal", write_areal_run)


@pytest.fixture(scope="session")
def verl_critic(tmp_path_factory: pytest.TempPathFactory) -> WrittenVerlCritic:
    """verl 0.9.1's own FSDPCheckpointManager saving an FSDP1 critic (a tiny Qwen2 as `...ForTokenClassification`
    with one label) on 2 CPU ranks, and the values it computes on fixed ids (slow: spawns)."""
    return build_once(tmp_path_factory, "verl-critic", write_verl_critic)


@pytest.fixture(scope="session")
def areal_critic(tmp_path_factory: pytest.TempPathFactory) -> WrittenArealCritic:
    """AReaL's own PPO critic (`FSDPPPOCritic`, a tiny Qwen3 as `...ForTokenClassification` with one label) on one
    CPU rank: its Saver export and recover slot, and the values it computes on fixed ids (slow: spawns)."""
    return build_once(tmp_path_factory, "areal-critic", write_areal_critic)


@pytest.fixture(scope="session")
def openrlhf_ppo(deepspeed_writers: DeepSpeedWriters) -> WrittenOpenRlhf:
    """OpenRLHF 0.11.2's own PPO saves (DeepspeedStrategy, ZeRO-2, actor and critic) on 2 CPU ranks: global
    steps 1-3, a best tag at step 2, `{tag}_hf` exports and the final models (slow: spawns)."""
    return deepspeed_writers.openrlhf


@pytest.fixture(scope="session")
def megatron_runs(tmp_path_factory: pytest.TempPathFactory) -> WrittenMegatron:
    """megatron-core 0.16.1's `GPTModel` (TP 2 on 2 CPU ranks) holding a transformers Llama's weights, saved by
    `dist_checkpointing.save` as Megatron-LM saves: iterations 1 and 2 with the tracker, a release save, a
    tied-embeddings save, and the source models (slow: spawns)."""
    return build_once(tmp_path_factory, "megatron", write_megatron_runs)


@pytest.fixture(scope="session")
def accelerate_runs(tmp_path_factory: pytest.TempPathFactory) -> WrittenAccelerate:
    """accelerate 1.15 `save_state` on CPU: a plain run with automatic checkpoint naming (checkpoint_0..2), a
    user-named `.bin` save, a resumed copy, a DeepSpeed ZeRO-2 run and an FSDP2 save (slow: a subprocess)."""
    return build_once(tmp_path_factory, "accelerate", write_accelerate_runs)


@pytest.fixture(scope="session")
def deepspeed_wrappers(tmp_path_factory: pytest.TempPathFactory) -> WrittenWrapperRuns:
    """The HF Trainer and accelerate with DeepSpeed ZeRO-2 on 2 CPU ranks, and `ds_to_universal` of each one's
    latest tag (slow: spawns)."""
    return build_once(tmp_path_factory, "deepspeed-wrappers", write_wrapper_runs)


@pytest.fixture(scope="session")
def torchtitan_run(tmp_path_factory: pytest.TempPathFactory) -> WrittenTorchtitan:
    """torchtitan 0.3.0's CheckpointManager on its own tiny Llama 3: step-1, step-2 and the model-only step-3."""
    return build_once(tmp_path_factory, "torchtitan", write_torchtitan_run)


def copy_tree(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst, symlinks=True)
    return dst


def torch_zip_records(folder: Path, layout: Layout) -> list[tuple[str, ZipMember]]:
    """(file, record) of every tensor record (not a pickle) of the torch.save zips `layout` names in the
    checkpoint at `folder` (`Layout.torch_archives`): where to flip a byte that plain verify's CRC-32 check
    must name."""
    from ckptctl.formats.torch_zip import archive_members

    checkpoint = layout.open(str(folder))
    found = []
    for archive in layout.torch_archives(checkpoint):
        data = (folder / archive.file).read_bytes() if archive.file else folder.read_bytes()
        end = len(data) if archive.length is None else archive.offset + archive.length
        blob = data[archive.offset : end]
        if blob[:4] != b"PK\x03\x04":
            continue
        members = archive_members(lambda start, n, b=blob: b[start : start + n], len(blob), archive.offset, "")
        found += [(archive.file, m) for m in members.members if m.size and not m.name.endswith(".pkl")]
    return found


@dataclass
class CliResult:
    exit_code: int
    stdout: str
    stderr: str

    @property
    def json(self) -> Any:
        return json.loads(self.stdout)


@pytest.fixture
def run_cli(capsys: pytest.CaptureFixture[str]) -> Iterator[Callable[..., CliResult]]:
    """Run `ckptctl ARGS...` in-process through `main` (the real error boundary) and capture its streams."""
    from ckptctl.cli.app import main

    def run(*args: str | os.PathLike[str]) -> CliResult:
        argv: Sequence[str] = [os.fspath(a) for a in args]
        capsys.readouterr()
        try:
            main(argv)
            code = 0
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 2)
        captured = capsys.readouterr()
        return CliResult(code, captured.out, captured.err)

    yield run
