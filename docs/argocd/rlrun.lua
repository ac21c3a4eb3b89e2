-- Argo CD health check of a legorl.dev RLRun (argocd-cm key resource.customizations.health.legorl.dev_RLRun).
-- The operator derives status.phase from the run's conditions; this maps it onto Argo CD's states the
-- way Argo CD treats Jobs and Workflows: a run that is still working is Progressing, a finished one
-- Healthy, a failed, invalid or degraded one Degraded, a suspended one Suspended.
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

local phase = obj.status.phase
if phase == nil or phase == "" then
  -- An older status without a phase: the same order as the operator's rlrun_phase().
  local function is(type_, value)
    local c = condition(type_)
    return c ~= nil and c.status == value
  end
  if is("Succeeded", "True") then
    phase = "Succeeded"
  elseif is("Failed", "True") then
    phase = "Failed"
  elseif is("Validated", "False") then
    phase = "Invalid"
  elseif obj.spec ~= nil and obj.spec.suspend == true then
    phase = "Suspended"
  elseif is("Degraded", "True") then
    phase = "Degraded"
  elseif is("Training", "True") then
    phase = "Running"
  else
    phase = "Pending"
  end
end

local reason = obj.status.reason or ""
local label = phase
if reason ~= "" then
  label = phase .. " (" .. reason .. ")"
end
local step = tostring(obj.status.step or 0)
local steps = ""
if obj.spec ~= nil and obj.spec.stop ~= nil and obj.spec.stop.maxSteps ~= nil then
  steps = " of " .. tostring(obj.spec.stop.maxSteps)
end

if phase == "Succeeded" then
  hs.status = "Healthy"
  hs.message = explain(label, condition("Succeeded"))
elseif phase == "Failed" then
  hs.status = "Degraded"
  hs.message = explain(label, condition("Failed"))
elseif phase == "Invalid" then
  hs.status = "Degraded"
  hs.message = explain(label, condition("Validated"))
elseif phase == "Degraded" then
  hs.status = "Degraded"
  hs.message = explain(label .. " at step " .. step .. steps, condition("Degraded"))
elseif phase == "Suspended" then
  hs.status = "Suspended"
  hs.message = label .. " at step " .. step .. steps
elseif phase == "Running" then
  hs.status = "Progressing"
  hs.message = label .. ": step " .. step .. steps
else
  -- Pending (waiting for the fleet or the pool), or a phase this script does not know yet.
  local waiting = condition("RolloutReady")
  if waiting == nil or waiting.status == "True" then
    waiting = condition("SandboxesReady")
  end
  if waiting ~= nil and waiting.status == "True" then
    waiting = condition("Training")
  end
  hs.status = "Progressing"
  hs.message = explain(label, waiting)
end
return hs
