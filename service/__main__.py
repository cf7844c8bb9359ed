"""`python -m service --artifacts DIR [--host H] [--port P] [--workers N]` (what `dcmc serve` runs).

The flags become environment variables, so every uvicorn worker builds the same Settings. The artifact is
verified here first: a missing or tampered artifact stops start-up with one clear line and exit status 2.
"""

from __future__ import annotations

import argparse
import atexit
import os
import shutil
import sys
import tempfile
from pathlib import Path

# One BLAS thread per worker: requests are small, and workers (not threads) use the cores.
for _var in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_var, "1")


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of `python -m service`."""
    parser = argparse.ArgumentParser(prog="python -m service", description="Serve a DCMC artifact over HTTP.")
    parser.add_argument("--artifacts", required=True, help="artifact directory written by `dcmc train`")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--workers", type=int, default=1, help="uvicorn worker processes")
    return parser


def main(argv: list[str] | None = None) -> int:
    """Check the artifact and the settings, then run uvicorn; returns the exit status."""
    args = build_parser().parse_args(argv)
    if args.workers < 1:
        print("dcmc serve: error: --workers must be >= 1", file=sys.stderr)
        return 2
    os.environ["DCMC_ARTIFACTS"] = str(args.artifacts)
    if args.workers > 1 and not os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
        metrics_dir = tempfile.mkdtemp(prefix="dcmc-metrics-")
        atexit.register(shutil.rmtree, metrics_dir, ignore_errors=True)
        os.environ["PROMETHEUS_MULTIPROC_DIR"] = metrics_dir

    import uvicorn
    from pydantic import ValidationError

    from model.artifact import ArtifactError, read_config, verify
    from model.config import ConfigError
    from model.experiments import ExperimentError
    from model.scorers import check_inference
    from service.experiments import load_experiments, variant_settings
    from service.scoring import effective_inference
    from service.settings import Settings

    try:
        settings = Settings()
        verify(settings.artifacts)
        model_config, stored = read_config(settings.artifacts)
        check_inference(effective_inference(stored, settings), model_config)
        experiments = load_experiments(settings)
        for experiment, variant in experiments.model_variants() if experiments is not None else []:
            where = f"experiment {experiment.id!r}, variant {variant.name!r}: "
            try:
                own = Path(variant.artifact) if variant.artifact else settings.artifacts
                verify(own)
                model_config, stored = read_config(own)
                check_inference(
                    effective_inference(stored, variant_settings(settings, variant)), model_config
                )
            except (ArtifactError, ConfigError) as exc:
                raise ExperimentError(where + str(exc)) from None
    except ExperimentError as exc:
        print(f"dcmc serve: error: {exc}", file=sys.stderr)
        return 2
    except ValidationError as exc:
        print(f"dcmc serve: error: invalid settings: {exc}", file=sys.stderr)
        return 2
    except (ArtifactError, ConfigError) as exc:
        print(f"dcmc serve: error: {exc}", file=sys.stderr)
        return 2
    uvicorn.run(
        "service.main:app_factory",
        factory=True,
        host=args.host,
        port=args.port,
        workers=args.workers,
        log_level=settings.log_level,
        access_log=False,
        timeout_keep_alive=settings.keep_alive_s,
        timeout_graceful_shutdown=10,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
