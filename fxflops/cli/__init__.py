"""The `fxflops` command: argument parsing and output (main), model specs (model_spec), the built-in
examples, stage progress, and the light entry point (console). Importing this package loads nothing
heavy, so the entry point can take Ctrl-C while torch is still loading."""
