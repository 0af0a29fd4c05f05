"""placeholder"""
import argparse


def configure_judge(parser: argparse.ArgumentParser) -> None:
    pass
