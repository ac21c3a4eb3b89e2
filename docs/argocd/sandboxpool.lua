-- Argo CD health check of a legorl.dev SandboxPool (argocd-cm key
-- resource.customizations.health.legorl.dev_SandboxPool), from its Ready, ImagesCached,
-- DefensesVerified and Degraded conditions: Degraded when the operator says so (pulls failed, no
-- matching nodes, a failed defense self-test, warm sandboxes failing) or the spec is invalid, Healthy
-- when trials can start, Progressing while images are pulled or the self-test runs.
-- Lua 5.1 (Argo CD's gopher-lua); tested in tests/operator/test_argocd_health.py.
local hs = {}

local function condition(type_)
  for _, c in ipairs(obj.status.conditions or {}) do
    if c.type == type_ then
      return c
    end
  end
  return nil
end

local function explain(text, c)
  if c ~= nil and c.message ~= nil and c.message ~= "" then
    return text .. ": " .. c.message
  end
  return text
end

if obj.status == nil or obj.status.conditions == nil then
  hs.status = "Progressing"
  hs.message = "Waiting for the operator to report status"
  return hs
end
local generation = obj.metadata.generation
local observed = obj.status.observedGeneration
if generation ~= nil and (observed == nil or observed < generation) then
  hs.status = "Progressing"
  hs.message = "Waiting for the operator to reconcile generation " .. tostring(generation)
  return hs
end

local ready = condition("Ready")
local degraded = condition("Degraded")
local defenses = condition("DefensesVerified")

if degraded ~= nil and degraded.status == "True" then
  hs.status = "Degraded"
  hs.message = explain(degraded.reason or "Degraded", degraded)
elseif ready ~= nil and ready.status == "False" and ready.reason == "InvalidSpec" then
  hs.status = "Degraded"
  hs.message = explain("InvalidSpec", ready)
elseif defenses ~= nil and defenses.status == "False" and defenses.reason == "SelfTestFailed" then
  hs.status = "Degraded"
  hs.message = explain("SelfTestFailed", defenses)
elseif ready ~= nil and ready.status == "True" then
  hs.status = "Healthy"
  hs.message = explain(ready.reason or "Ready", ready)
else
  hs.status = "Progressing"
  if ready ~= nil then
    hs.message = explain(ready.reason or "NotReady", ready)
  else
    hs.message = "Waiting for the Ready condition"
  end
end
return hs
