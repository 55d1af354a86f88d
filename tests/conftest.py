import os

# Qt must not look for a display; set before any QApplication exists (setdefault keeps xvfb runs possible).
os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")
os.environ.setdefault("XDG_RUNTIME_DIR", "/tmp/runtime-" + str(os.getuid()))
os.makedirs(os.environ["XDG_RUNTIME_DIR"], mode=0o700, exist_ok=True)

import pytest  # noqa: E402
import torch  # noqa: E402

torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))


def pytest_configure(config: pytest.Config) -> None:
    from tests.requires import required

    required()  # an unknown name in INFERENCE_LAB_REQUIRE stops the run before any test


def _fail_undeclared_skip(report: pytest.TestReport | pytest.CollectReport) -> None:
    """Where the run declares its dependencies (`make test`), only a skip for a dependency it does not require may
    pass (tests/requires.py): any other skip is a test that did not run, and must not leave the run green."""
    from tests.requires import ENV, SKIP_PREFIX, required

    if not report.skipped or hasattr(report, "wasxfail") or not os.environ.get(ENV):
        return
    r = report.longrepr
    reason = (r[2] if isinstance(r, tuple) else str(r)).removeprefix("Skipped: ")
    if reason.startswith(SKIP_PREFIX) and reason.split(":")[0].split()[-1] not in required():
        return
    report.outcome = "failed"
    report.longrepr = f"skipped where {ENV} is set (every test must run there): {reason}"


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    report = yield
    _fail_undeclared_skip(report)
    return report


@pytest.hookimpl(wrapper=True)
def pytest_make_collect_report(collector):
    report = yield
    _fail_undeclared_skip(report)
    return report


@pytest.fixture(scope="session", autouse=True)
def _private_cache(tmp_path_factory):
    """Tests never write into the user's cache: each test session converts the real model once, privately."""
    os.environ.setdefault("INFERENCE_LAB_CACHE", str(tmp_path_factory.mktemp("cache")))
    yield


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory):
    """A tiny random Llama checkpoint written both as a GGUF file and as a Hugging Face directory."""
    from tests.tiny_model import write_tiny_checkpoints

    return write_tiny_checkpoints(tmp_path_factory.mktemp("tiny"))


@pytest.fixture(scope="session")
def tiny_lm(tiny_dir):
    from engine.loaders import load

    return load(tiny_dir.gguf, device="cpu", dtype="float32", use_cache=False)


@pytest.fixture(scope="session")
def hf_from_gguf():
    """transformers' own float32 model of a GGUF file (transformers dequantizes it itself): the reference several
    modules hold the engine to, loaded once per test session (its GGUF loader takes a minute for Gemma 3)."""
    import torch

    from tests.requires import import_required

    transformers = import_required("transformers")
    loaded: dict[str, object] = {}

    def get(path):
        key = str(path)
        if key not in loaded:
            loaded[key] = transformers.AutoModelForCausalLM.from_pretrained(
                str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()
        return loaded[key]

    yield get
    loaded.clear()


@pytest.fixture(scope="session")
def real_lm():
    """The real default model (SmolLM2-135M-Instruct), loaded once per test session."""
    from engine.loaders import load
    from tests.requires import default_model

    return load(default_model(), device="cpu", dtype="float32")
