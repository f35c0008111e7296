"""The `memlens` command line: one file per verb, each thin (parse, call the library, render)."""
