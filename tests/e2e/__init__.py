"""What tests/test_trainers_e2e.py and tests/test_launcher.py run in child processes: the
trainers' drivers (driver.py and the two it dispatches to), the data they train on
(data.py), and a worker that builds a speculators draft under torchrun (build_draft.py);
install.py: whether the package, and so its startup hook, is installed."""
