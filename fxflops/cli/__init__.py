"""The `fxflops` command: the light entry point (console), main (errors as one line), the argument
parser (parser), running a command (commands, checks) and writing its output (output); MODEL specs
(model_spec dispatching to hf_specs and factories, with inputs and options), the built-in examples,
and stage progress. Importing this package loads nothing heavy, so the entry point can take Ctrl-C
while torch is still loading."""
