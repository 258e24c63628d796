"""`nfshunt run`'s own settings of the Python process."""
import gc

from nfshunt import controller


def test_the_controller_collects_its_youngest_objects_less_often():
    saved = gc.get_threshold()
    try:
        controller.tune_gc()
        assert gc.get_threshold() == (controller.GC_YOUNG, *saved[1:])
        assert controller.GC_YOUNG > saved[0]
    finally:
        gc.set_threshold(*saved)
