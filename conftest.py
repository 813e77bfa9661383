# Settings for every test process, the notebooks' kernels included (they inherit the environment):
# - a written step or a prediction that fails its check raises (flashedu.course): the solved
#   notebooks must pass every check; the learner's notebooks, with their steps unwritten, run on;
# - checks record progress in a file of this run, never in the user's own record.
import os
import tempfile

os.environ["FLASHEDU_COURSE_STRICT"] = "1"
os.environ.setdefault("FLASHEDU_PROGRESS",
                      os.path.join(tempfile.mkdtemp(prefix="flashedu-test-"), "progress.json"))
