"""Paper studies: a study file expanded into runs, each finished run kept as one record of
a committed results file, and the records summarised into tables and figures.

One module per job: :mod:`~fedplug.study.spec` (the study file), :mod:`~fedplug.study.expansion`
(its runs), :mod:`~fedplug.study.run_folders` (config hashes, reusing run folders),
:mod:`~fedplug.study.records` (results files), :mod:`~fedplug.study.provenance` (which code
trained each record), :mod:`~fedplug.study.statistics`, :mod:`~fedplug.study.tables`,
:mod:`~fedplug.study.quotes` (the numbers a verdict quotes), :mod:`~fedplug.study.plots` and
:mod:`~fedplug.study.figures`; the search of a ``tune:`` section: :mod:`~fedplug.study.tuning`,
:mod:`~fedplug.study.trials` (every trial a record), :mod:`~fedplug.study.tuning_records`
(``tuned.json`` and MLflow); the cross-paper benchmark's statistics and page:
:mod:`~fedplug.study.table_statistics`, :mod:`~fedplug.study.benchmark_numbers`,
:mod:`~fedplug.study.benchmark_page`, :mod:`~fedplug.study.benchmark_heatmap`.
The names below are the steps a study runner calls, in order.
"""

from fedplug.study.expansion import StudyRun, expand_study
from fedplug.study.figures import draw_figures
from fedplug.study.records import dump_records, load_records, run_record
from fedplug.study.run_folders import config_hash, pending_runs, run_folder_state
from fedplug.study.spec import StudySpec, parse_study
from fedplug.study.statistics import summarise
from fedplug.study.tables import summary_table

__all__ = [
    "StudyRun",
    "StudySpec",
    "config_hash",
    "draw_figures",
    "dump_records",
    "expand_study",
    "load_records",
    "parse_study",
    "pending_runs",
    "run_folder_state",
    "run_record",
    "summarise",
    "summary_table",
]
