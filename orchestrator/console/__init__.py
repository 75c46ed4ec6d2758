"""What the terminal shows while runs train (`progress`): one line per report of each run or trial, one progress
line per sweep, one-line failure reasons, and the `--verbose` switch every process reads. Free of Ray; the
launcher's Ray callbacks (launch/ray_console.py) feed it."""

from orchestrator import lazy_face

OFFERS = dict.fromkeys(["emit", "verbose", "set_verbose", "VERBOSE_ENV", "report_line", "trial_label",
                        "describe_config", "failure_reason", "next_step", "SweepProgress"], "progress")
__all__ = sorted(OFFERS)
__getattr__, __dir__ = lazy_face(__name__, OFFERS)
