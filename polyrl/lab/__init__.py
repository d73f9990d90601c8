"""Multi-method x multi-seed comparisons: analysis, collapse detection, ScaleRL sigmoid fits and reports.

results = analyse("runs/compare", threshold=0.5)   # OUT/<method>/seed<k>/metrics.jsonl -> plain dict
write_report(results, "runs/compare")              # plots/*.png, results.json, report.html
print_ranking(results)
"""

from polyrl.collapse import CollapseMonitor, CollapseRule, first_collapse
from polyrl.lab.analysis import Run, analyse, analyse_runs, load_runs
from polyrl.lab.report import print_ranking, write_report
from polyrl.lab.stats import bootstrap_ci, fit_sigmoid, sigmoid_law

__all__ = [
    "CollapseMonitor",
    "CollapseRule",
    "Run",
    "analyse",
    "analyse_runs",
    "bootstrap_ci",
    "first_collapse",
    "fit_sigmoid",
    "load_runs",
    "print_ranking",
    "sigmoid_law",
    "write_report",
]
