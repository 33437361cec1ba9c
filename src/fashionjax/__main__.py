from fashionjax.cli import run

run()
