"""Builds the gRPC stubs from the repository's proto/ when the package is built: they are
generated, never committed. epserve.proto is the service; inference.proto (KServe v2) carries
the shared-memory path."""

import os
import re
import shutil
import tempfile

from setuptools import setup
from setuptools.command.build_py import build_py

HERE = os.path.dirname(os.path.abspath(__file__))
PROTOS = ("epserve.proto", "inference.proto", "model_config.proto")


def proto_dir():
    for d in (os.path.join(HERE, "..", "..", "proto"), os.path.join(HERE, "proto")):
        if all(os.path.isfile(os.path.join(d, p)) for p in PROTOS):
            return d
    raise SystemExit(f"epserve: {PROTOS} not found in ../../proto (build from the repository)")


class BuildWithStubs(build_py):
    def run(self):
        super().run()
        from grpc_tools import protoc
        import grpc_tools

        out = os.path.join(self.build_lib, "epserve", "_proto")
        os.makedirs(out, exist_ok=True)
        with tempfile.TemporaryDirectory() as tmp:
            for p in PROTOS:
                shutil.copy(os.path.join(proto_dir(), p), tmp)
            include = os.path.join(os.path.dirname(grpc_tools.__file__), "_proto")
            args = ["protoc", f"-I{tmp}", f"-I{include}", f"--python_out={out}", f"--grpc_python_out={out}"]
            if protoc.main(args + [os.path.join(tmp, p) for p in PROTOS]) != 0:
                raise SystemExit("epserve: protoc failed")
        # protoc writes top-level imports (`import epserve_pb2`); inside a package they are relative.
        for name in os.listdir(out):
            if name.endswith(".py"):
                path = os.path.join(out, name)
                with open(path) as f:
                    text = f.read()
                text = re.sub(r"^import (\w+_pb2) as", r"from . import \1 as", text, flags=re.M)
                with open(path, "w") as f:
                    f.write(text)
        with open(os.path.join(out, "__init__.py"), "w") as f:
            f.write('"""Generated from proto/ when the package was built."""\n')


setup(cmdclass={"build_py": BuildWithStubs})
