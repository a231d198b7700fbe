"""Reward functions in the shapes users bring (verl's and the positional one), for
test_reward_contract.py; a light module, since RewardPool workers import it by dotted path."""


def verl_four(data_source, solution_str, ground_truth, extra_info):
    return {"score": float(solution_str == ground_truth), "acc": solution_str == ground_truth, "pred": solution_str,
            "index": extra_info["index"], "src_len": len(data_source)}


def verl_gsm8k(solution_str, ground_truth, method="strict", format_score=0.0, score=1.0):
    return score if solution_str.endswith(ground_truth) else format_score


def verl_kwargs(data_source, solution_str, ground_truth, extra_info=None, **kwargs):
    return True if kwargs == {} and extra_info["split"] == "train" else 0.5


def only_kwargs(**kw):
    return float(sorted(kw) == ["data_source", "extra_info", "ground_truth", "solution_str"])


def positional(response, answer, metadata):
    return 0.25 + float(response == answer) + 0.5 * (metadata.get("data_source") == "my_math")


def ground_truth_type(data_source, solution_str, ground_truth, extra_info):
    return {"score": 1.0, "is_int": isinstance(ground_truth, int)}


def returns_none(response, answer, metadata):
    return None


class Scorer:
    def __call__(self, solution_str, ground_truth):
        return 2.0


def verl_math_verify(model_output, ground_truth, timeout_score=0):
    """verl's reward_score/math_verify.py shape: the response under another name, first."""
    return {"score": model_output.endswith(ground_truth), "acc": __import__("numpy").bool_(True)}


def numpy_score(solution_str, ground_truth, **kwargs):
    import numpy as np

    return np.float32(0.5) if sorted(kwargs) == ["data_source", "extra_info"] else np.float64(0.0)
