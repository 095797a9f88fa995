"""Package discovery for the design card's layout: lang/ is `plait`, runtime/ is `plait.runtime`,
grammars/ is `plait.grammars`. Subpackages are found on disk so new folders need no edit here."""

from setuptools import find_packages, setup

ROOTS = {"plait": "lang", "plait.runtime": "runtime", "plait.grammars": "grammars"}

packages = []
package_dir = {}
for name, folder in ROOTS.items():
    packages.append(name)
    package_dir[name] = folder
    for sub in find_packages(folder):
        packages.append(f"{name}.{sub}")
        package_dir[f"{name}.{sub}"] = f"{folder}/{sub.replace('.', '/')}"

setup(packages=packages, package_dir=package_dir)
