"""peft's own ParamWrapper adapter (target_parameters) run once, as the reference scripts record it
(model_ref.py, nvfp4_ref.py)."""
import torch


def record(pm, ids, labels, generator, ref, adapter_dir):
    """Non-zero lora_B (0.3 x N(0, 1) from `generator`), then one forward and backward of peft model
    `pm` on (ids, labels): ref gets logits_params, loss_params and grad_params.<peft name> of every
    LoRA tensor (zeros where no gradient reached it), and adapter_dir the adapter as peft saves it."""
    with torch.no_grad():
        for n, p in pm.named_parameters():
            if "lora_B" in n:
                p.copy_(0.3 * torch.randn(p.shape, generator=generator))
    o = pm(input_ids=ids, labels=labels)
    o.loss.backward()
    ref["logits_params"], ref["loss_params"] = o.logits.detach(), o.loss.detach().reshape(1)
    for n, p in pm.named_parameters():
        if "lora_" in n:
            grad = p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p)
            ref["grad_params." + n.replace(".default", "")] = grad
    pm.save_pretrained(adapter_dir)
