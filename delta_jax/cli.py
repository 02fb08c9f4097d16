"""What the `python -m delta_jax.<command>` entry points share: logging setup, model arguments,
the device mesh and the joining of processes.

Every command is a package whose `__init__` is the library and whose `__main__` is the command
line (argparse, printing results, exit codes). Library code logs through
`logging.getLogger(__name__)`; a command calls `setup_logging()` first, so that delta_jax's
messages (INFO and up) reach the terminal on stderr, while the results it was asked for (and
the trainer's progress lines) go to stdout.
"""
from __future__ import annotations

import argparse
import logging
import os
import sys
from typing import TYPE_CHECKING, NoReturn

from delta_jax.config import DTYPES

if TYPE_CHECKING:
    from jax.sharding import Mesh

MESH_HELP = ("run on a DATA,FSDP,TENSOR device mesh, sizes within each TPU slice or GPU node "
             "(one may be -1: the devices left), e.g. 1,4,2; over several slices or nodes add "
             "/DCN_DATA,DCN_FSDP,DCN_TENSOR, the slices each axis spans (default /-1,1,1: the "
             "slices go on data). Parameters are loaded onto their shardings. Default: one "
             "device")
DISTRIBUTED_HELP = ("join the processes of a multi-process run (jax.distributed) before touching "
                    "a device: COORDINATOR_HOST:PORT,NUM_PROCESSES,PROCESS_ID (launch/local.sh "
                    "passes it), or alone to let SLURM or a Cloud TPU pod describe itself")


class _StderrHandler(logging.StreamHandler):
    """Writes to sys.stderr as it is at each record (as logging.lastResort does), so a handler
    set up once follows a later redirection of stderr."""

    def __init__(self):
        logging.Handler.__init__(self)

    @property
    def stream(self):
        return sys.stderr


def setup_logging() -> None:
    """delta_jax's INFO messages and every library's warnings to stderr, one line each.

    force=True: importing orbax already configured the root logger (absl calls basicConfig on
    its first record); a command owns its process's logging and replaces that.
    """
    logging.basicConfig(level=logging.WARNING, handlers=[_StderrHandler()], force=True,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
                        datefmt="%Y-%m-%d %H:%M:%S")
    logging.getLogger("delta_jax").setLevel(logging.INFO)


EXIT_USER_ERROR = 2  # argparse's code for a bad command line


def exit_with_error(message: str) -> NoReturn:
    """End on a user's mistake (a bad flag, config key or value, or file): one `error:` line on
    stderr, naming what is at fault and what was expected, and exit code 2; no traceback.
    A message of several lines (a YAML parser's, say) is joined into one with "; "."""
    one_line = "; ".join(line.strip() for line in message.splitlines() if line.strip())
    print(f"error: {one_line}", file=sys.stderr, flush=True)
    sys.exit(EXIT_USER_ERROR)


def add_model_arguments(parser: argparse.ArgumentParser) -> None:
    """--model, --step and --dtype of the commands that read a model through load_model."""
    parser.add_argument("--model", required=True,
                        help="Orbax checkpoint dir, training run folder or Hugging Face folder")
    parser.add_argument("--step", type=int, help="checkpoint step (default: the latest)")
    parser.add_argument("--dtype", choices=DTYPES, help="compute dtype (default: the checkpoint's)")
    add_parallel_arguments(parser)


def add_parallel_arguments(parser: argparse.ArgumentParser, distributed: bool = True) -> None:
    """--mesh and --distributed: a model sharded over devices, possibly of several processes."""
    parser.add_argument("--mesh", metavar="DATA,FSDP,TENSOR[/DCN...]", help=MESH_HELP)
    if distributed:
        parser.add_argument("--distributed", nargs="?", const="auto", metavar="HOST:PORT,N,I",
                            help=DISTRIBUTED_HELP)


def initialize_distributed(coordinator_address: str | None = None,
                           num_processes: int | None = None,
                           process_id: int | None = None) -> None:
    """jax.distributed.initialize, before any device is touched.

    With the three arguments unset, SLURM and Cloud TPU pods describe themselves to JAX. CPU
    processes talk through gloo.
    """
    import jax

    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(coordinator_address=coordinator_address,
                               num_processes=num_processes, process_id=process_id)


def start_processes(args: argparse.Namespace) -> None:
    """Joins the processes when --distributed was given (see DISTRIBUTED_HELP)."""
    if getattr(args, "distributed", None) is None:
        return
    if args.distributed == "auto":
        initialize_distributed()
        return
    try:
        address, count, index = args.distributed.split(",")
        count, index = int(count), int(index)
        if ":" not in address or not 0 <= index < count:
            raise ValueError
    except ValueError:
        raise ValueError(f"--distributed {args.distributed}: expected HOST:PORT,NUM_PROCESSES,"
                         "PROCESS_ID with 0 <= PROCESS_ID < NUM_PROCESSES, e.g. "
                         "localhost:1234,2,0") from None
    initialize_distributed(address, count, index)


def _mesh_sizes(text: str) -> list[int]:
    """"1,4,2" -> [1, 4, 2]: three sizes >= 1, one of which may be -1; else ValueError."""
    sizes = [int(n) for n in text.split(",")]
    if len(sizes) != 3 or any(n < 1 and n != -1 for n in sizes) or sizes.count(-1) > 1:
        raise ValueError(text)
    return sizes


def mesh_from_args(args: argparse.Namespace) -> Mesh | None:
    """The mesh that --mesh names, or None (one device)."""
    if args.mesh is None:
        return None
    from delta_jax.sharding import ACROSS_SLICES_DEFAULT, make_hybrid_mesh  # jax only when needed

    within, slash, across = args.mesh.partition("/")
    try:
        per_slice = _mesh_sizes(within)
        across_slices = _mesh_sizes(across) if slash else ACROSS_SLICES_DEFAULT
    except ValueError:
        raise ValueError(f"--mesh {args.mesh}: expected three device counts DATA,FSDP,TENSOR, "
                         "such as 1,4,2 (one may be -1: the devices left), optionally "
                         "followed by /DCN_DATA,DCN_FSDP,DCN_TENSOR") from None
    try:
        return make_hybrid_mesh(per_slice, across_slices)
    except ValueError as err:
        raise ValueError(f"--mesh {args.mesh}: {err}") from None


COMPILATION_CACHE_DIR = "~/.cache/delta_jax/jax"
# Every program is stored, however quickly it compiled (JAX's default skips those under 1 s):
# a restart then loads the train step and the sharded initialisation instead of compiling them.
# No size limit: JAX's needs the filelock package, which the requirements do not include.
_COMPILATION_CACHE_SETTINGS = {"jax_persistent_cache_min_compile_time_secs": 0.0}


def enable_compilation_cache(directory: str | None = COMPILATION_CACHE_DIR) -> None:
    """Keep compiled programs in `directory` (a leading ~ is expanded; None: leave JAX's settings
    alone) so that the next start, e.g. after a preemption, loads them instead of compiling.

    Call before anything is compiled. JAX's own environment variables win:
    JAX_COMPILATION_CACHE_DIR names another directory, JAX_ENABLE_COMPILATION_CACHE=false turns
    the cache off, JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS replaces the setting above.
    """
    import jax

    if directory is None or not jax.config.jax_enable_compilation_cache:
        return
    settings = {"jax_compilation_cache_dir": os.path.expanduser(directory),
                **_COMPILATION_CACHE_SETTINGS}
    for name, value in settings.items():
        if name.upper() not in os.environ:
            jax.config.update(name, value)
