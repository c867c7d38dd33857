"""Tags the wheel for the platform its plugin was built on (py3-none-<plat>):
the package holds a compiled shared library but no Python extension, so
setuptools would otherwise call it pure."""

import sysconfig

from setuptools import setup
from setuptools.command.bdist_wheel import bdist_wheel


class PlatformWheel(bdist_wheel):
    def finalize_options(self):
        super().finalize_options()
        self.root_is_pure = False

    def get_tag(self):
        return "py3", "none", sysconfig.get_platform().replace("-", "_").replace(".", "_")


setup(cmdclass={"bdist_wheel": PlatformWheel})
