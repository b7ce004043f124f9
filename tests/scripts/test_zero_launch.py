"""zero-launch's hostfile, selection, exports and the commands --dry-run prints."""
import importlib.machinery
import importlib.util
import io
import os
import sys
import tempfile
import unittest
from contextlib import redirect_stderr, redirect_stdout

HERE = os.path.dirname(os.path.abspath(__file__))
SCRIPT = os.environ.get("ZERO_LAUNCH", os.path.join(HERE, "..", "..", "scripts", "zero-launch"))
loader = importlib.machinery.SourceFileLoader("zero_launch", SCRIPT)
spec = importlib.util.spec_from_loader("zero_launch", loader)
zl = importlib.util.module_from_spec(spec)
loader.exec_module(zl)

HOSTFILE = "worker-0 slots=2\n# a comment\n\nworker-1 slots=4   # the big one\n"


def dry_run(args, environ=None, hostfile=HOSTFILE):
    """(exit code, stdout, stderr) of zero-launch --dry-run args with a hostfile."""
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "hostfile")
        with open(path, "w") as f:
            f.write(hostfile)
        out, err = io.StringIO(), io.StringIO()
        cwd = os.getcwd()
        os.chdir(d)  # no stray ./.zero_env
        try:
            with redirect_stdout(out), redirect_stderr(err):
                rc = zl.main(["-H", path, "--dry-run"] + args,
                             environ if environ is not None else {"HOME": d})
        finally:
            os.chdir(cwd)
        return rc, out.getvalue().strip(), err.getvalue().strip()


class Hostfile(unittest.TestCase):
    def test_parses_hosts_slots_and_comments(self):
        self.assertEqual(zl.parse_hostfile(HOSTFILE), {"worker-0": 2, "worker-1": 4})

    def test_names_the_bad_line(self):
        for text, words in (("a slots=2\nb slots\n", "hostfile:2: expected 'host slots=N'"),
                            ("a slots=0\n", "slots=0"),
                            ("a slots=1\na slots=2\n", "listed twice"),
                            ("# nothing\n", "no hosts")):
            with self.assertRaises(zl.LaunchError) as e:
                zl.parse_hostfile(text)
            self.assertIn(words, str(e.exception))


class Selection(unittest.TestCase):
    hosts = {"worker-0": 2, "worker-1": 4}

    def test_include_exclude_nodes_gpus(self):
        self.assertEqual(zl.select(self.hosts), {"worker-0": [0, 1], "worker-1": [0, 1, 2, 3]})
        self.assertEqual(zl.select(self.hosts, include="worker-1:0,2"), {"worker-1": [0, 2]})
        self.assertEqual(zl.select(self.hosts, exclude="worker-1:1@worker-0"),
                         {"worker-1": [0, 2, 3]})
        self.assertEqual(zl.select(self.hosts, num_nodes=1), {"worker-0": [0, 1]})
        self.assertEqual(zl.select(self.hosts, num_gpus=1), {"worker-0": [0], "worker-1": [0]})

    def test_errors(self):
        for kwargs, words in (({"include": "a", "exclude": "b"}, "cannot be used together"),
                              ({"include": "worker-9"}, "worker-9 is not in the hostfile"),
                              ({"include": "worker-0:5"}, "not [5]"),
                              ({"num_nodes": 3}, "2 hosts are available"),
                              ({"exclude": "worker-0@worker-1"}, "no host left")):
            with self.assertRaises(zl.LaunchError) as e:
                zl.select(self.hosts, **kwargs)
            self.assertIn(words, str(e.exception))

    def test_slurm_nodelist(self):
        self.assertEqual(zl.expand_nodelist("n[01-03,7],gpu"), ["n01", "n02", "n03", "n7", "gpu"])
        # Text after a group, and several groups in one name (the suffix became a host).
        self.assertEqual(zl.expand_nodelist("gpu-[01-02]-ib"), ["gpu-01-ib", "gpu-02-ib"])
        self.assertEqual(zl.expand_nodelist("r[1-2]n[1-2],x"), ["r1n1", "r1n2", "r2n1", "r2n2", "x"])
        with self.assertRaises(zl.LaunchError):
            zl.expand_nodelist("n[a-b]")


class DryRun(unittest.TestCase):
    def test_openmpi_default(self):
        rc, out, _ = dry_run(["./train_gpt", "--steps", "4"])
        self.assertEqual(rc, 0)
        self.assertEqual(out, "mpirun -n 6 --host worker-0:2,worker-1:4 ./train_gpt --steps 4")

    def test_openmpi_exports_and_launcher_args(self):
        env = {"HOME": "/nonexistent", "OMP_NUM_THREADS": "2", "NCCL_DEBUG": "INFO", "USER": "x"}
        rc, out, _ = dry_run(["-x", "MY_FLAG=1 2", "--launcher_args", "--mca btl tcp,self",
                              "--num_nodes", "1", "./p"], env)
        self.assertEqual(rc, 0)
        self.assertEqual(out, "mpirun -n 2 -x NCCL_DEBUG=INFO -x OMP_NUM_THREADS=2 "
                              "-x 'MY_FLAG=1 2' --mca btl tcp,self --host worker-0:2 ./p")

    def test_narrowed_slots_get_their_devices(self):
        rc, out, _ = dry_run(["-i", "worker-0@worker-1:1,3", "./p"])
        self.assertEqual(rc, 0)
        self.assertEqual(out, "mpirun -n 2 --host worker-0:2 env CUDA_VISIBLE_DEVICES=0,1 ./p : "
                              "-n 2 --host worker-1:2 env CUDA_VISIBLE_DEVICES=1,3 ./p")

    def test_separator_before_the_program_is_dropped(self):
        # argparse's REMAINDER keeps "--"; "env CUDA_VISIBLE_DEVICES=1 -- ./p" runs "--".
        rc, out, _ = dry_run(["-i", "worker-1:1", "--", "./p", "--steps", "3"])
        self.assertEqual(rc, 0)
        self.assertEqual(out, "mpirun -n 1 --host worker-1:1 env CUDA_VISIBLE_DEVICES=1 ./p --steps 3")

    def test_mpich(self):
        rc, out, _ = dry_run(["--launcher", "mpich", "-x", "A=1", "./p"])
        self.assertEqual(out, "mpiexec -n 6 -genv A 1 -hosts worker-0:2,worker-1:4 ./p")

    def test_slurm(self):
        rc, out, _ = dry_run(["--launcher", "slurm", "--num_gpus", "2", "-x", "A=1", "./p"])
        self.assertEqual(rc, 0)
        self.assertEqual(out, "env A=1 srun -n 4 --nodes=2 --ntasks-per-node=2 --export=ALL "
                              "--nodelist=worker-0,worker-1 ./p")
        rc, _, err = dry_run(["--launcher", "slurm", "./p"])  # 2 and 4 slots: uneven
        self.assertEqual(rc, 2)
        self.assertIn("same number of ranks", err)

    def test_slurm_exports_values_with_commas_whole(self):
        # --export=ALL,NAME=a,b would hand the ranks NAME=a: the values travel in srun's
        # environment instead.
        rc, out, _ = dry_run(["--launcher", "slurm", "--num_gpus", "2",
                              "-x", "NCCL_SOCKET_IFNAME=eth0,eth1", "./p"])
        self.assertEqual(rc, 0)
        self.assertEqual(out, "env NCCL_SOCKET_IFNAME=eth0,eth1 srun -n 4 --nodes=2 "
                              "--ntasks-per-node=2 --export=ALL --nodelist=worker-0,worker-1 ./p")

    def test_slurm_narrowed_slots_get_their_devices(self):
        rc, out, _ = dry_run(["--launcher", "slurm", "-i", "worker-1:1,3", "./p"])
        self.assertEqual(rc, 0)
        self.assertEqual(out, "env CUDA_VISIBLE_DEVICES=1,3 srun -n 2 --nodes=1 "
                              "--ntasks-per-node=2 --export=ALL --nodelist=worker-1 ./p")
        # srun cannot give nodes different devices.
        rc, _, err = dry_run(["--launcher", "slurm", "-i", "worker-0:0@worker-1:1", "./p"])
        self.assertEqual(rc, 2)
        self.assertIn("narrowed slots must be the same on every node", err)

    def test_num_gpus_beyond_a_hosts_slots_is_an_error(self):
        rc, _, err = dry_run(["--num_gpus", "8", "./p"])
        self.assertEqual(rc, 2)
        self.assertIn("--num_gpus 8: more slots than a host offers (worker-0 has 2, "
                      "worker-1 has 4)", err)

    def test_slurm_tasks_and_gpus_per_node_from_the_job(self):
        def run(args, **extra):
            env = {"HOME": "/nonexistent", "SLURM_JOB_ID": "7", "SLURM_JOB_NODELIST": "gpu[1-2]"}
            env.update(extra)
            out, err = io.StringIO(), io.StringIO()
            with redirect_stdout(out), redirect_stderr(err):
                rc = zl.main(["--dry-run"] + args + ["./p"], env)
            return rc, out.getvalue().strip(), err.getvalue().strip()
        # SLURM_NTASKS_PER_NODE is set only with --ntasks-per-node; SLURM_TASKS_PER_NODE always.
        rc, out, err = run([], SLURM_TASKS_PER_NODE="4(x2)")
        self.assertEqual(rc, 0, err)
        self.assertIn("srun -n 8 --nodes=2 --ntasks-per-node=4", out)
        # --num_gpus is GPUs per node, as DeepSpeed's: it raises the allocation's one task too.
        rc, out, err = run(["--num_gpus", "8"], SLURM_TASKS_PER_NODE="1(x2)")
        self.assertEqual(rc, 0, err)
        self.assertIn("srun -n 16 --nodes=2 --ntasks-per-node=8", out)
        rc, _, err = run([], SLURM_TASKS_PER_NODE="2,1")  # uneven
        self.assertEqual(rc, 2)
        self.assertIn("same number of ranks", err)
        rc, _, err = run([], SLURM_TASKS_PER_NODE="4(x3)")
        self.assertEqual(rc, 2)
        self.assertIn("gives 3 nodes but SLURM_JOB_NODELIST has 2", err)
        rc, _, err = run([], SLURM_NTASKS_PER_NODE="", SLURM_TASKS_PER_NODE="x")
        self.assertEqual(rc, 2)
        self.assertIn("SLURM_TASKS_PER_NODE=x: expected counts", err)

    def test_slurm_from_the_job_environment(self):
        env = {"HOME": "/nonexistent", "SLURM_JOB_ID": "7", "SLURM_JOB_NODELIST": "gpu[1-2]",
               "SLURM_NTASKS_PER_NODE": "8(x2)"}
        out, err = io.StringIO(), io.StringIO()
        with redirect_stdout(out), redirect_stderr(err):
            rc = zl.main(["--dry-run", "./p"], env)
        self.assertEqual(rc, 0, err.getvalue())
        self.assertEqual(out.getvalue().strip(),
                         "srun -n 16 --nodes=2 --ntasks-per-node=8 --export=ALL "
                         "--nodelist=gpu1,gpu2 ./p")

    def test_errors_exit_2_with_a_message(self):
        rc, _, err = dry_run(["-x", "UNSET_THING", "./p"])
        self.assertEqual(rc, 2)
        self.assertIn("-x UNSET_THING: not set", err)
        rc, _, err = dry_run(["./p"], hostfile="worker-0 slots=two\n")
        self.assertEqual(rc, 2)
        self.assertIn(":1: expected 'host slots=N'", err)


class EnvFiles(unittest.TestCase):
    """~/.zero_env, then ./.zero_env over it (DeepSpeed's order: the project's file wins)."""

    def launch(self, home_text, project_text):
        with tempfile.TemporaryDirectory() as d:
            home, project = os.path.join(d, "home"), os.path.join(d, "project")
            for folder, text in ((home, home_text), (project, project_text)):
                os.mkdir(folder)
                with open(os.path.join(folder, ".zero_env"), "w") as f:
                    f.write(text)
            out, err = io.StringIO(), io.StringIO()
            cwd = os.getcwd()
            os.chdir(project)
            try:
                with redirect_stdout(out), redirect_stderr(err):
                    rc = zl.main(["--dry-run", "./p"], {"HOME": home})
            finally:
                os.chdir(cwd)
            return rc, out.getvalue().strip(), err.getvalue().strip()

    def test_project_file_wins_over_home(self):
        rc, out, _ = self.launch("A=home\nB=home\n", "# project\nA=project\n")
        self.assertEqual(rc, 0)
        self.assertEqual(out, "mpirun -n 1 -x A=project -x B=home --host localhost:1 ./p")

    def test_a_shell_export_line_is_an_error_naming_file_and_line(self):
        rc, out, err = self.launch("A=1\n", "B=2\nexport FOO=1\n")
        self.assertEqual(rc, 2)
        self.assertEqual(out, "")
        self.assertIn(".zero_env:2: 'export FOO' is not a variable name", err)


if __name__ == "__main__":
    unittest.main()
