"""Rendering of estimates and profiles: DeepSpeed-style text, tabulate tables, JSON and CSV."""

from fxflops.report.formats import (
    duration_to_string,
    flops_to_string,
    macs_to_string,
    number_to_string,
    params_to_string,
    percent,
)
from fxflops.report.machine import (
    CSV_COLUMNS,
    SCHEMA,
    SCHEMA_VERSION,
    from_dict,
    from_json,
    to_csv,
    to_dict,
    to_json,
)
from fxflops.report.tables import module_table, op_table
from fxflops.report.text import render

__all__ = [
    "CSV_COLUMNS",
    "SCHEMA",
    "SCHEMA_VERSION",
    "duration_to_string",
    "flops_to_string",
    "from_dict",
    "from_json",
    "macs_to_string",
    "module_table",
    "number_to_string",
    "op_table",
    "params_to_string",
    "percent",
    "render",
    "to_csv",
    "to_dict",
    "to_json",
]
