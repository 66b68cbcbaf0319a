"""GradientSums: an update's gradients summed without copies, never writing autograd's tensors."""

from __future__ import annotations

import torch

from pl_pipedream.runtime.gradient_sums import GradientSums


def test_the_first_gradient_is_kept_as_it_is() -> None:
    sums, grad = GradientSums(), torch.ones(3)
    sums.add(["w"], [grad])
    assert sums.get("w") is grad
    assert sums.mean(1)["w"] is grad


def test_a_second_gradient_makes_a_new_sum_and_leaves_autograds_tensors_alone() -> None:
    sums, first, second = GradientSums(), torch.ones(3), torch.full((3,), 2.0)
    sums.add(["w"], [first])
    sums.add(["w"], [second])
    total = sums.get("w")
    assert total is not first and torch.equal(first, torch.ones(3))
    sums.add(["w"], [torch.full((3,), 3.0)])  # now in place: the sum is its own tensor
    assert sums.get("w") is total
    assert torch.equal(sums.mean(2)["w"], torch.full((3,), 3.0))
    assert torch.equal(second, torch.full((3,), 2.0))


def test_one_tensor_returned_for_two_parameters_is_copied_for_the_second() -> None:
    sums, grad = GradientSums(), torch.ones(2)
    sums.add(["a", "b", "c"], [grad, grad, None])
    assert sums.get("a") is not grad and sums.get("b") is not grad
    assert sums.get("c") is None
    gradients = sums.mean(2)
    assert torch.equal(grad, torch.ones(2))  # dividing never wrote into autograd's tensor
    assert torch.equal(gradients["a"], torch.full((2,), 0.5))
    assert torch.equal(gradients["b"], torch.full((2,), 0.5))


def test_totals_from_elsewhere_are_added_and_owned() -> None:
    sums, autograd = GradientSums(), torch.ones(2)
    sums.add(["w"], [autograd])
    total = torch.full((2,), 4.0)
    sums.add_totals({"w": total, "v": torch.full((2,), 2.0)})
    assert sums.get("w") is total and torch.equal(total, torch.full((2,), 5.0))
    gradients = sums.mean(2)
    assert gradients["w"] is total  # divided in place: the sum was handed over
    assert torch.equal(total, torch.full((2,), 2.5)) and torch.equal(autograd, torch.ones(2))


def test_a_popped_sum_leaves_the_update_and_mean_starts_the_next() -> None:
    sums = GradientSums()
    sums["tied"] = torch.ones(2)
    sums.add(["w"], [torch.ones(2)])
    assert torch.equal(sums.pop("tied"), torch.ones(2)) and sums.pop("tied") is None
    fresh = torch.full((2,), 6.0)
    sums.add(["tied"], [fresh])
    sums.mean(3)
    assert torch.equal(fresh, torch.full((2,), 6.0))  # no longer owned after the pop
    assert not sums
