"""The rule table, as data and code: rule files read and checked (files, checks), their entries and
presets (entries, presets), formulas (formula, with formula_helpers and formula_bounds), an op call
bound to names (binding), matching a call to a rule (table), and the (query, key) pairs an attention
mask keeps (kept_pairs, with mask_bands and mask_values).

The names below are what the rest of fxflops imports from `fxflops.rules`.
"""

from fxflops.rules.binding import OpCall, aten_key, bind_op_call, function_key
from fxflops.rules.entries import (
    CONVENTIONS,
    FAMILIES,
    MAX_FILE_BYTES,
    PRESET_TABLE,
    Entry,
    RuleEvaluationError,
    RuleFileError,
    RuleFileWarning,
    Rule,
    RuleSpec,
    ZeroList,
    default_rules_dir,
    preset,
)
from fxflops.rules.files import load_rule_dir, load_rule_file
from fxflops.rules.table import RuleTable, _shipped_entries, load_table, load_user_entries, table_with

__all__ = [
    "CONVENTIONS", "FAMILIES", "MAX_FILE_BYTES", "PRESET_TABLE", "Entry", "OpCall", "Rule", "RuleEvaluationError",
    "RuleFileError", "RuleFileWarning", "RuleSpec", "RuleTable", "ZeroList", "aten_key", "bind_op_call",
    "default_rules_dir", "function_key", "load_rule_dir", "load_rule_file", "load_table", "load_user_entries",
    "preset", "table_with",
]
