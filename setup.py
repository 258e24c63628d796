from setuptools import find_packages, setup

setup(
    name="nfshunt",
    version="0.1.0",
    description="OpenFlow hybrid shunting firewall controller (Netfilter slow path, OpenFlow fast path)",
    packages=find_packages(include=["nfshunt", "nfshunt.*"]),
    python_requires=">=3.11",
    install_requires=[
        "os-ken==4.2.2",
        "pyroute2==0.9.7",
        "prometheus-client==0.26.0",
    ],
    extras_require={"test": ["pytest==9.2.0", "hypothesis==6.170.15", "ruff==0.8.6", "mypy==2.4.1", "coverage==7.17.5",
                            "mutmut==3.8.1", "py-spy==0.4.3"]},
    entry_points={"console_scripts": ["nfshunt=nfshunt.cli:main"]},
)
