"""The commands of the command line, one module per room they call into: each has its
parser builders (`build_*`) and runners (`run_*`: parse, call the API, print, return an exit
code). cli.py holds the table of commands and dispatches; nothing here decides policy."""
