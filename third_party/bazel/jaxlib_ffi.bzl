"""Repository rule exposing the XLA FFI headers shipped with the local jaxlib (jax.ffi.include_dir())."""

def _jaxlib_ffi_headers_impl(rctx):
    python = rctx.os.environ.get("DSPARK_PYTHON", "python3")
    res = rctx.execute([python, "-c", "import jax.ffi; print(jax.ffi.include_dir())"])
    if res.return_code != 0:
        fail("cannot find the XLA FFI headers with %s (set DSPARK_PYTHON to a python with jaxlib): %s" % (python, res.stderr))
    rctx.symlink(res.stdout.strip() + "/xla", "xla")
    rctx.file("BUILD", """
cc_library(
    name = "ffi_api",
    hdrs = glob(["xla/ffi/api/*.h"]),
    includes = ["."],
    visibility = ["//visibility:public"],
)

filegroup(
    name = "ffi_headers",
    srcs = glob(["xla/ffi/api/*.h"]),
    visibility = ["//visibility:public"],
)
""")

jaxlib_ffi_headers = repository_rule(
    implementation = _jaxlib_ffi_headers_impl,
    environ = ["DSPARK_PYTHON"],
    local = True,
)
