from bench.cli import bench

bench(prog_name="python -m bench")
